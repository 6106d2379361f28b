"""benchmarks/suite_profile.py with its plugin (benchmarks/suite_events.py): a suite's time by file, and JAX's
compile events inside it, each test counted once (xdist's controller sees every report again)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = '''
import jax
import jax.numpy as jnp


def test_compiles():
    assert float(jax.jit(lambda x: x * 2 + 1)(jnp.float32(3))) == 7.0


def test_compiles_nothing():
    assert sum(range(4)) == 6
'''


@pytest.mark.parametrize("workers", ["0", "2"])
def test_each_test_is_counted_once_with_the_compiles_it_caused(tmp_path, workers):
    (tmp_path / "test_tiny.py").write_text(TINY)
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, "benchmarks/suite_profile.py", str(tmp_path / "test_tiny.py"),
                           "--workers", workers, "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["result"].startswith("2 passed"), result["result"]
    assert result["tests"] == 2 and len(result["files"]) == 1
    assert result["processes"] == 1        # the one that ran the file: not xdist's controller, nor an idle worker
    row = result["files"][0]
    assert row["file"].endswith("test_tiny.py") and row["tests"] == 2
    tests = {t["test"].rpartition("::")[2]: t for t in result["slowest_tests"]}
    assert tests["test_compiles"]["compile_s"] > 0 and tests["test_compiles"]["trace_s"] > 0
    assert tests["test_compiles_nothing"]["compile_s"] == 0 == tests["test_compiles_nothing"]["trace_s"]
    assert 0 < row["jax_s"] <= row["s"] + 0.01 and abs(result["test_s_summed"] - row["s"]) < 0.02
    assert result["jax_s_summed"]["compile_s"] >= tests["test_compiles"]["compile_s"]
    assert result["command"].startswith("python benchmarks/suite_profile.py ") and str(out) in result["command"]
