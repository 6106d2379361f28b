"""benchmarks/pool_runs.py: bench_train runs read as one (pooled rounds, run medians, the issue's targets) and the
runs it refuses to pool, refused before anything is written."""
import json
import os
import statistics
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import pool_runs  # noqa: E402  pylint: disable=wrong-import-position

EQUAL_FLAX = "equal work: bert_a@all tokens/s / HF Flax, its faster allocator"
TUPE_A = "tupe_a step / bert_a step"
LOOP = "loop tokens/s / benchmark bert_a tokens/s"


def run_file(tmp_path, name, started, ratios, **changes):
    """A bench_train-shaped result with `ratios` {key: per-round values}; `changes` override top-level fields or,
    as args_<name>, one argument."""
    args = {"steps": 8, "warmup": 2, "predictions": 20, "dropout": 0.1, "backend": "einsum", "equal_work": 1,
            "default_predictions": 20}
    top = {"shape": {"layers": 4, "hidden": 256, "seq": 128, "batch": 16}, "cpu": "some x86 CPU",
           "started": started, "command": "python benchmarks/bench_train.py ..."}
    for k, v in changes.items():
        (args if k.startswith("args_") else top)[k.removeprefix("args_")] = v
    top.update(args=args, ratios={k: {"median": statistics.median(v), "per_round": v} for k, v in ratios.items()})
    path = tmp_path / name
    path.write_text(json.dumps(top))
    return str(path)


def test_pools_rounds_and_counts_the_runs_that_meet_each_target(tmp_path, capsys):
    a = run_file(tmp_path, "a.json", "t1", {EQUAL_FLAX: [1.30, 1.25, 1.10], TUPE_A: [0.99, 1.01, 1.04],
                                           LOOP: [0.95, 0.97, 0.99], "only in a": [1.0, 1.0]}, git_commit="abc123")
    b = run_file(tmp_path, "b.json", "t2", {EQUAL_FLAX: [1.15, 1.18, 1.21, 1.19], TUPE_A: [1.02, 1.05, 1.03, 1.06],
                                           LOOP: [1.04, 1.05, 1.05, 1.08]})
    out = tmp_path / "pooled.json"
    assert pool_runs.main([a, b, "--json", str(out)]) == 0
    pooled = json.loads(out.read_text())
    assert [f["git_commit"] for f in pooled["files"]] == ["abc123", None]   # b predates the field
    ratios = pooled["ratios"]
    assert "only in a" not in ratios                       # a ratio some run lacks is left out
    flax = ratios[EQUAL_FLAX]
    assert flax["pooled"]["median"] == pytest.approx(statistics.median([1.30, 1.25, 1.10, 1.15, 1.18, 1.21, 1.19]))
    assert [r["median"] for r in flax["runs"]] == pytest.approx([1.25, 1.185])
    assert (flax["run_medians_min"], flax["run_medians_max"]) == pytest.approx((1.185, 1.25))
    assert not flax["pooled_meets"] and flax["runs_meeting"] == 1        # pooled 1.19; run medians 1.25, 1.185
    assert ratios[TUPE_A]["pooled_meets"] and ratios[TUPE_A]["runs_meeting"] == 1   # pooled 1.03; runs 1.01, 1.04
    assert ratios[LOOP]["runs_meeting"] == 2 and ratios[LOOP]["pooled_meets"]   # run medians 0.97 and 1.05: ends included
    assert "1 of 2" in capsys.readouterr().out


def test_target_ends_are_inclusive_and_open_sides_unbounded():
    assert pool_runs.meets(1.2, (1.2, None)) and not pool_runs.meets(1.1999, (1.2, None))
    assert pool_runs.meets(1.03, (None, 1.03)) and not pool_runs.meets(1.0301, (None, 1.03))
    assert pool_runs.meets(0.95, (0.95, 1.05)) and not pool_runs.meets(1.051, (0.95, 1.05))


@pytest.mark.parametrize("change,named", [({"shape": {"layers": 2}}, "shape="), ({"cpu": "another CPU"}, "cpu="),
                                          ({"args_steps": 4}, "args.steps="), ({"started": "t1"}, "again"),
                                          ({"args_allocator": "all"}, "args.allocator="),
                                          ({"args_torch_threads": 1}, "args.torch_threads=")])
def test_refuses_runs_that_are_not_alike_before_writing(tmp_path, capsys, change, named):
    change = dict(change)
    a = run_file(tmp_path, "a.json", "t1", {TUPE_A: [1.0, 1.0]})
    b = run_file(tmp_path, "b.json", change.pop("started", "t2"), {TUPE_A: [1.0, 1.0]}, **change)
    out = tmp_path / "pooled.json"
    out.write_bytes(b"earlier result\n")
    assert pool_runs.main([a, b, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().split("\n")
    assert len(err) == 1 and err[0].startswith("error: ") and named in err[0] and "b.json" in err[0]
    assert out.read_bytes() == b"earlier result\n"


def test_refuses_one_run_and_files_that_are_not_results(tmp_path, capsys):
    a = run_file(tmp_path, "a.json", "t1", {TUPE_A: [1.0]})
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"ratios": {}}))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    for argv, named in [([a], "1 run given"), ([a, str(other)], "not a bench_train result"),
                        ([a, str(broken)], "cannot read")]:
        assert pool_runs.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and named in err and "\n" not in err


def test_plot_is_written_and_a_missing_folder_refused_before_anything(tmp_path, capsys):
    a = run_file(tmp_path, "a.json", "t1", {EQUAL_FLAX: [1.30, 1.25], TUPE_A: [0.99, 1.01], LOOP: [0.95, 0.97]})
    b = run_file(tmp_path, "b.json", "t2", {EQUAL_FLAX: [1.15, 1.18], TUPE_A: [1.02, 1.05], LOOP: [1.04, 1.05]})
    png, out = tmp_path / "pooled.png", tmp_path / "pooled.json"
    assert pool_runs.main([a, b, "--json", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.exists()
    capsys.readouterr()
    out.write_bytes(b"earlier result\n")
    missing = tmp_path / "no such folder" / "pooled.png"
    assert pool_runs.main([a, b, "--json", str(out), "--plot", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "--plot" in err and "\n" not in err
    assert out.read_bytes() == b"earlier result\n" and not missing.parent.exists()


def test_plot_refused_when_the_runs_share_no_target_ratio(tmp_path, capsys):
    a = run_file(tmp_path, "a.json", "t1", {"some other ratio": [1.0, 1.1]})
    b = run_file(tmp_path, "b.json", "t2", {"some other ratio": [1.2, 1.3]})
    png, out = tmp_path / "pooled.png", tmp_path / "pooled.json"
    assert pool_runs.main([a, b, "--json", str(out), "--plot", str(png)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "--plot" in err and "\n" not in err
    assert not png.exists() and not out.exists()
    assert pool_runs.main([a, b, "--json", str(out)]) == 0       # without the plot the same runs pool


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_an_output_that_is_one_of_the_runs_is_refused_and_the_run_kept(tmp_path, capsys, flag):
    """`--json a.json` (or `--plot b.json`) replaced that input run with the pooled result (or a PNG)."""
    a = run_file(tmp_path, "a.json", "t1", {EQUAL_FLAX: [1.30, 1.25], TUPE_A: [0.99, 1.01]})
    b = run_file(tmp_path, "b.json", "t2", {EQUAL_FLAX: [1.15, 1.18], TUPE_A: [1.02, 1.05]})
    before = {p: open(p, "rb").read() for p in (a, b)}
    os.symlink(b, tmp_path / "link.json")
    for out in (a, str(tmp_path / "link.json")):        # the same file by another name as well
        assert pool_runs.main([a, b, flag, out]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {flag} {out} is one of the runs to pool") and "\n" not in err
    assert {p: open(p, "rb").read() for p in (a, b)} == before
    same = tmp_path / "pooled"
    assert pool_runs.main([a, b, "--json", str(same), "--plot", str(same)]) == 2
    assert "both name" in capsys.readouterr().err and not same.exists()
