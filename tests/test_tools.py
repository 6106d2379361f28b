"""The scripts in tools/ that write committed results: they never replace them with less."""
import hashlib
import json
import os
import shutil
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


def _findings_copy(tmp_path):
    """A copy of tools/findings_table.py, README.md and docs/experiments/ in tmp_path (the script works beside them)."""
    (tmp_path / "tools").mkdir()
    shutil.copy(os.path.join(ROOT, "tools", "findings_table.py"), tmp_path / "tools")
    shutil.copy(os.path.join(ROOT, "README.md"), tmp_path)
    shutil.copytree(os.path.join(ROOT, "docs", "experiments"), tmp_path / "docs" / "experiments")
    return lambda *a: subprocess.run([sys.executable, str(tmp_path / "tools" / "findings_table.py"), *a],
                                     env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                                     timeout=120, check=False)


def test_the_findings_table_never_drops_a_suite_or_trips_on_a_bad_report(tmp_path):
    """A missing report.json dropped its suite's rows from README.md (exit 0); bad JSON was a traceback."""
    table = _findings_copy(tmp_path)
    readme = (tmp_path / "README.md").read_bytes()
    assert table("--write").returncode == 0 and (tmp_path / "README.md").read_bytes() == readme   # up to date
    report = tmp_path / "docs" / "experiments" / "tupe" / "report.json"
    text = report.read_text()
    report.unlink()
    shown = table()
    assert shown.returncode == 0 and "no report for tupe" in shown.stderr
    assert "(docs/experiments/tupe/" not in shown.stdout
    refused = table("--write")
    assert refused.returncode == 2 and refused.stderr.startswith("error: the README's findings table has rows of tupe")
    assert (tmp_path / "README.md").read_bytes() == readme
    for bad in (text[:200], json.dumps({**json.loads(text), "findings": [{"claim": "x"}]})):
        report.write_text(bad)
        out = table("--write")
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and out.stderr.startswith("error: "), out.stderr
        assert "tupe/report.json" in out.stderr and (tmp_path / "README.md").read_bytes() == readme


def test_run_experiments_checks_every_step_before_the_first_runs():
    """An unknown step was found only when reached, after the steps before it had trained (hours)."""
    script = os.path.join(ROOT, "tools", "run_experiments.sh")
    bad = subprocess.run(["bash", script, "extrapolation", "bogus"], env={**os.environ, "PY": "echo"},
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.startswith("error: unknown step 'bogus'")
    good = subprocess.run(["bash", script, "extrapolation probe"], env={**os.environ, "PY": "echo"},
                          capture_output=True, text=True, timeout=60, check=False)
    assert good.returncode == 0 and [line.split()[3] for line in good.stdout.splitlines()] == [
        "--config=configs/compare.py:suite=extrapolation", "--config=configs/compare.py:suite=probe"]
