"""benchmarks/bench_matmul.py: torch's rate over XLA-with-oneDNN's per round, and its refusals (no compute)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_matmul import ONEDNN, TORCH, torch_over_onednn  # noqa: E402  pylint: disable=wrong-import-position


def test_ratio_is_taken_within_each_round_then_the_median():
    per = {f"a | {ONEDNN}": [100.0, 200.0, 50.0, 100.0, 100.0, 100.0],
           f"a | {TORCH}": [150.0, 200.0, 100.0, 90.0, 120.0, 130.0],       # per round: 1.5, 1, 2, 0.9, 1.2, 1.3
           "a | XLA": [1.0] * 6}
    r = torch_over_onednn(per)
    assert list(r) == ["a"]
    assert r["a"]["median"] == pytest.approx(1.25) and (r["a"]["min"], r["a"]["max"]) == (0.9, 2.0)
    assert r["a"]["ci95"] == [0.9, 2.0]


def test_products_without_both_engines_have_no_ratio():
    per = {f"a | {TORCH} bmm": [2.0] * 6, f"a | {ONEDNN}": [1.0] * 6, f"b | {TORCH}": [1.0] * 6, "c | XLA": [1.0] * 6}
    r = torch_over_onednn(per)
    assert list(r) == ["a"] and r["a"]["median"] == 2.0


@pytest.mark.parametrize("argv,message", [
    (["--attention", "--engines"], "error: --attention and --engines together"),
    (["--json", "/no/such/folder/x.json"], "error: no folder for --json"),
])
def test_refusals_are_one_line_before_any_compute(tmp_path, argv, message):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_matmul.py"), *argv],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False)
    assert done.returncode != 0 and done.stderr.strip().startswith(message) and len(done.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("rounds", [3, 6])
def test_the_report_prints_and_writes_the_ratio_with_or_without_an_interval(tmp_path, capsys, rounds):
    """Below 6 rounds `spread` gives no interval: the report falls back to the min–max (it raised, after the timing)."""
    import argparse  # pylint: disable=import-outside-toplevel
    import json  # pylint: disable=import-outside-toplevel
    from bench_matmul import report  # pylint: disable=import-outside-toplevel
    per = {f"a | {ONEDNN}": [100.0, 200.0, 50.0, 100.0, 100.0, 100.0][:rounds],
           f"a | {TORCH}": [150.0, 200.0, 100.0, 90.0, 120.0, 130.0][:rounds]}
    out = tmp_path / "r.json"
    report(argparse.Namespace(attention=False, engines=True, json=str(out)), per, (0.0, 0.0, 0.0))
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| a | ")][-1]
    assert row == ("| a | 1.500 (1.000–2.000) |" if rounds == 3 else "| a | 1.250 (0.900–2.000) |")
    assert json.loads(out.read_text())["torch_over_onednn"]["a"]["median"] == pytest.approx(1.5 if rounds == 3 else 1.25)
