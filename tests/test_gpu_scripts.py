"""The device session's prepared scripts (benchmarks/gpu_round2.sh) still run: their Python paths on this CPU, at
smoke sizes, with the flags the script passes. A device session is rare and its minutes are few, so a script broken
by a change elsewhere should fail here, not there. Off a GPU, cuDNN is refused with its own error and the pallas
backend trains through the einsum path (its kernels run interpreted where a script asks for them)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def run(script: str, *args: str, tmp_path) -> dict:
    out = tmp_path / f"{script}.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args, "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_mfu_script_runs_the_paper_recipe_configurations(tmp_path):
    """Step 5's configurations (attention dropout 0.1; einsum, and pallas for the three schemes) and step 6's pallas
    row, at smoke size: every row has a step time and a finite loss."""
    result = run("gpu_mfu.py", "--smoke", "--attention_dropout", "0.1", "--configs",
                 "bert_a:bias:einsum,bert_a:bias:pallas,tupe_r:bias:pallas,tupe_a:bias:pallas", tmp_path=tmp_path)
    rows = result["rows"]
    assert [(r["scheme"], r["backend"]) for r in rows] == [("bert_a", "einsum"), ("bert_a", "pallas"),
                                                          ("tupe_r", "pallas"), ("tupe_a", "pallas")]
    for row in rows:
        assert "error" not in row, row
        assert row["step_ms"] > 0 and row["final_loss"] == row["final_loss"] and row["attention_dropout"] == 0.1
        assert row["pallas_dropout_mask"] == "precomputed" and row["last_layer_rows"] == "predicted"


def test_the_mfu_script_reports_cudnn_refused_off_a_gpu_and_runs_the_causal_xla_rows(tmp_path):
    """Step 7's flags (clm, both causal-mask modes): cuDNN rows carry cuDNN's own error here, the xla rows run."""
    result = run("gpu_mfu.py", "--smoke", "--objective", "clm", "--causal_mask", "explicit,native", "--configs",
                 "alibi:bias:cudnn,alibi:bias:xla", tmp_path=tmp_path)
    rows = result["rows"]
    assert [(r["backend"], r["causal_mask"]) for r in rows] == [("cudnn", "explicit"), ("cudnn", "native"),
                                                               ("xla", "explicit"), ("xla", "native")]
    assert all("cuDNN" in r["error"] for r in rows[:2]), rows[:2]
    assert all("error" not in r and r["objective"] == "clm" for r in rows[2:]), rows[2:]


def test_the_pallas_phases_and_bisect_scripts_compile_the_backward(tmp_path):
    """Step 1 (the precomputed mask, bias, dropout 0.1; a small shape) gets as far as running the backward, which is
    what gpu_round2.sh greps for; step 4's bisect compiles each backward kernel alone (interpreted here)."""
    phases = run("gpu_pallas_phases.py", "--rate", "0.1", "--bias", "--heads", "2", "--batch", "1", "--length", "128",
                 "--dropout_mask", "precomputed", tmp_path=tmp_path)
    assert "backward run 0" in json.dumps(phases)
    bisect = run("gpu_pallas_bisect.py", "--interpret", "--timeout", "120", "--dump_root", str(tmp_path / "dumps"),
                 tmp_path=tmp_path)
    assert bisect["interpret"] and bisect["rows"], bisect
    assert all(row["status"] == "compiled" for row in bisect["rows"]), bisect["rows"]
