"""benchmarks/bench_demo.py: each setting's wall is compared with the first's within its round, the single-setting
file keeps its older key, an unknown malloc setting is refused before any run, a failed run stops with one line
naming its command, and `--command compare` is the extrapolation suite at few steps."""
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_demo as B  # noqa: E402  pylint: disable=wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def row(walls, rss):
    return {"wall_s": walls, "max_rss_mb": rss}


def span(summary):
    return {k: summary[k] for k in ("median", "min", "max")}


def test_the_wall_ratio_is_taken_within_each_round():
    rows = [row({"auto": 50.0, "hugepages": 100.0}, {"auto": 1200, "hugepages": 1000}),
            row({"auto": 80.0, "hugepages": 88.0}, {"auto": 1300, "hugepages": 1100}),     # a slow round for auto
            row({"auto": 55.0, "hugepages": 66.0}, {"auto": 1250, "hugepages": 1050})]
    out = B.summarise(rows, ["auto", "hugepages"])["per_allocator"]
    ratio = span(out["hugepages"]["wall_over_first"])
    assert ratio == pytest.approx({"median": 1.2, "min": 1.1, "max": 2.0})     # not 88 / 55
    assert span(out["auto"]["wall_over_first"]) == {"median": 1.0, "min": 1.0, "max": 1.0}
    assert span(out["auto"]["wall_s"]) == {"median": 55.0, "min": 50.0, "max": 80.0}
    assert span(out["hugepages"]["max_rss_mb"]) == {"median": 1050, "min": 1000, "max": 1100}


def test_one_setting_keeps_the_older_files_top_level_wall():
    out = B.summarise([row({"": 60.0}, {"": 900}), row({"": 70.0}, {"": 950})], [""])
    assert span(out["wall_s"]) == {"median": 65.0, "min": 60.0, "max": 70.0}
    assert "wall_s" not in B.summarise([row({"a": 1.0, "b": 2.0}, {"a": 1, "b": 1})], ["a", "b"])


def test_an_unknown_setting_is_refused_before_any_demo(tmp_path):
    out = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "benchmarks/bench_demo.py", "--allocators", "auto,jemalloc",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: unknown settings 'jemalloc', --allocators, use some of auto,tbbmalloc,hugepages,system"]
    assert list(tmp_path.iterdir()) == []


def test_a_failed_run_stops_with_one_line_naming_the_command(tmp_path, monkeypatch):
    monkeypatch.setitem(B.COMMANDS, "compare", ["pretrian"])       # launch refuses an unknown command, exit 2
    with pytest.raises(SystemExit) as stop:
        B.run_once(str(tmp_path), "system", "compare")
    message = str(stop.value)
    assert message.startswith("error: the compare failed (error: ") and "'pretrian'" in message.split(")")[0]
    assert message.endswith("python -m launch pretrian with TUPE_JAX_ALLOCATOR=system, run it by hand to see why")


def test_the_compare_command_is_the_extrapolation_suite_at_few_steps():
    assert B.COMMANDS["demo"] == ["demo"]
    assert B.COMMANDS["compare"][:2] == ["compare", "--config=configs/compare.py:suite=extrapolation"]
    assert f"--config.train.steps={B.COMPARE_STEPS}" in B.COMMANDS["compare"] and B.COMPARE_STEPS <= 200
