"""The scripts in tools/ that write committed results: they never replace them with less."""
import hashlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _scan(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "scale_scan.py"), "--report_only", *args],
                          cwd="/", capture_output=True, text=True, timeout=120, check=False)


def _fake_run(runs, name):
    os.makedirs(runs / name)
    rows = [{"step": 25, "loss": 7.0, "step_time_s": 0.5}, {"step": 50, "eval_loss": 6.0, "eval_mlm_accuracy": 0.1}]
    (runs / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_scale_scan_never_replaces_a_scan_with_fewer_runs(tmp_path):
    """`--report_only` on a clone without runs/scan wrote an empty scan over docs/experiments/scale (exit 0)."""
    out = tmp_path / "scale"
    out.mkdir()
    (out / "scan.json").write_text(json.dumps({"runs": {"tiny-bert_a-mlm": {}, "tiny-nopos-mlm": {}}}))
    digest = hashlib.sha1((out / "scan.json").read_bytes()).hexdigest()
    empty = _scan(f"--runs={tmp_path / 'none'}", f"--out={out}")
    assert empty.returncode != 0 and "no runs with metrics.jsonl" in empty.stderr
    _fake_run(tmp_path / "runs", "tiny-bert_a-mlm")
    fewer = _scan(f"--runs={tmp_path / 'runs'}", f"--out={out}")
    assert fewer.returncode != 0 and "lacks (tiny-nopos-mlm)" in fewer.stderr, fewer.stderr
    assert sorted(os.listdir(out)) == ["scan.json"]
    assert hashlib.sha1((out / "scan.json").read_bytes()).hexdigest() == digest
    _fake_run(tmp_path / "runs", "tiny-nopos-mlm")    # every run the scan had: written (out is absolute here)
    ok = _scan(f"--runs={tmp_path / 'runs'}", f"--out={out}")
    assert ok.returncode == 0, ok.stderr
    assert set(json.loads((out / "scan.json").read_text())["runs"]) == {"tiny-bert_a-mlm", "tiny-nopos-mlm"}


def test_the_scale_scan_reads_a_run_history_as_read_metrics_does(tmp_path):
    """It parsed metrics.jsonl itself: a `launch evaluate` row became a point of the curve, the rows a resumed run
    redid were counted twice, and a torn last row was a traceback."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import scale_scan  # pylint: disable=import-outside-toplevel
    finally:
        sys.path.pop(0)
    rows = [{"step": 25, "loss": 7.0, "step_time_s": 0.5}, {"step": 50, "eval_loss": 6.0},
            {"step": 75, "loss": 9.0, "step_time_s": 0.5}, {"step": 100, "eval_loss": 9.9},      # redone below
            {"step": 50, "event": "resumed"}, {"step": 75, "loss": 5.0, "step_time_s": 0.5},
            {"step": 100, "eval_loss": 5.5}, {"step": 100, "eval_loss": 5.4, "split": "validation"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 1')
    curve = scale_scan.curve(str(tmp_path))
    assert [(r["step"], r["eval_loss"]) for r in curve] == [(50, 6.0), (100, 5.5)]
    assert [round(r["minutes"] * 60, 6) for r in curve] == [12.5, 37.5]     # 0.5 s x 75 steps by step 100
