"""`launch report` on the committed suites' report.json and on broken ones: each committed report re-renders to the
committed REPORT.md; a report.json edited into another shape, or a folder where a PNG goes, is one line and leaves
every file of the folder as it was (no half-written report, no temporary file)."""
import json
import os
import shutil

import pytest

import launch
from tests.workdir_fixtures import tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(ROOT, "docs", "experiments")


def suite_copy(tmp_path, suite="probe"):
    folder = tmp_path / suite
    folder.mkdir()
    shutil.copy(os.path.join(EXPERIMENTS, suite, "report.json"), folder)
    return folder


@pytest.mark.parametrize("suite", ["probe", "tupe"])
def test_a_committed_report_renders_to_its_committed_markdown(tmp_path, suite):
    folder = suite_copy(tmp_path, suite)
    assert launch.main(["report", f"--workdir={folder}"]) == 0
    with open(os.path.join(EXPERIMENTS, suite, "REPORT.md"), encoding="utf-8") as f:
        assert (folder / "REPORT.md").read_text() == f.read()
    assert sorted(os.listdir(folder)) == sorted(["REPORT.md", "report.json", "loss_curves.png"]
                                                + (["probe.png"] if suite == "probe" else ["glue.png"]))


def _final_eval_string(r):
    r["schemes"][0]["seeds"]["0"]["final_eval"]["eval_loss"] = "5.1"


def _scheme_seeds_list(r):
    r["schemes"][0]["seeds"] = [1]


@pytest.mark.parametrize("edit", [
    lambda r: r.update(seeds="0,1,2"), lambda r: r.update(schemes={}), lambda r: r.update(schemes=[]),
    lambda r: r.update(config=[]), _final_eval_string, _scheme_seeds_list,
    lambda r: r["schemes"][0]["seeds"]["0"].update(final_eval="x"), lambda r: r.update(config={})])
def test_a_report_json_of_another_shape_is_one_line_and_changes_nothing(tmp_path, capsys, edit):
    """Each was a traceback ("unexpected TypeError ..."), some after report.json had been rewritten with new
    verdicts; `seeds` as a string rendered "Seeds 0, ,, 1"."""
    folder = suite_copy(tmp_path)
    assert launch.main(["report", f"--workdir={folder}"]) == 0
    report = json.loads((folder / "report.json").read_text())
    edit(report)
    (folder / "report.json").write_text(json.dumps(report))
    before = tree(str(folder))
    capsys.readouterr()
    assert launch.main(["report", f"--workdir={folder}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "does not hold what a compare report holds" in err
    assert tree(str(folder)) == before


def test_a_folder_named_like_a_plot_is_refused_before_any_file_is_replaced(tmp_path, capsys):
    """The folder made `report` crash half-way: loss_curves.png replaced, a .tmp.png left behind."""
    folder = suite_copy(tmp_path)
    assert launch.main(["report", f"--workdir={folder}"]) == 0
    os.remove(folder / "probe.png")
    (folder / "probe.png").mkdir()
    (folder / "REPORT.md").write_text("an older report\n")
    before = tree(str(folder))
    capsys.readouterr()
    assert launch.main(["report", f"--workdir={folder}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {folder / 'probe.png'} is a folder, --workdir, move it aside")
    assert tree(str(folder)) == before and sorted(os.listdir(folder)) == ["REPORT.md", "loss_curves.png",
                                                                          "probe.png", "report.json"]


@pytest.mark.parametrize("suite,key", [("probe", "probe"), ("extrapolation", "extrapolation")])
def test_a_scheme_whose_every_seed_diverged_keeps_its_row(tmp_path, suite, key):
    """The analysis tables left such a scheme out (only REPORT.md's diverged line named its runs); its row now
    counts the seeds it lacks, as a partly diverged scheme's cells do ("(2 of 3)")."""
    folder = suite_copy(tmp_path, suite)
    report = json.loads((folder / "report.json").read_text())
    gone, partly = report["schemes"][-1], report["schemes"][0]
    n = len(gone["seeds"])
    for run in gone["seeds"].values():
        run.update(diverged="training diverged at step 4 (loss=nan)", final_eval={})
    partly["seeds"]["1"].update(diverged="training diverged at step 4 (loss=nan)", final_eval={})
    paths = {r["path"] for r in gone["seeds"].values()} | {partly["seeds"]["1"]["path"]}
    for analysis in report[key].values():
        analysis["runs"] = [r for r in analysis["runs"] if r["workdir"] not in paths]
    (folder / "report.json").write_text(json.dumps(report))
    assert launch.main(["report", f"--workdir={folder}"]) == 0
    table = (folder / "REPORT.md").read_text().split("## Extrapolation" if key == "extrapolation" else
                                                   "## Position probes")[1].split("\n## ")[0]
    row = next(line for line in table.splitlines() if line.startswith(f"| `{gone['name']}` |"))
    assert row.count(f"— (0 of {n})") >= 2
    partly_row = next(line for line in table.splitlines() if line.startswith(f"| `{partly['name']}` |"))
    assert f"({n - 1} of {n})" in partly_row


def test_the_command_line_names_each_default_changed_since_the_suite_ran():
    """A suite made before `model.dropout_bits` or `model.last_layer_rows` existed, or with a value today's
    configs no longer default to, gets the flags that make its command train the same runs again; keys the
    command sets itself, or that its objective does not read, get none. The table's defaults are today's."""
    from configs.compare import get_config
    from tupe_jax.analysis.report import CHANGED_DEFAULTS, _older_defaults
    today = get_config("suite=tupe").model
    assert [(key, now) for key, now, *_ in CHANGED_DEFAULTS] == [(key, today[key]) for key, *_ in CHANGED_DEFAULTS]

    def flags(model, objectives=("mlm",), command="python -m launch compare --workdir=w"):
        line = _older_defaults({"config": {"model": model}, "command": command,
                                "schemes": [{"objective": o} for o in objectives]})
        return line[line.index("add `") + 5:line.rindex("`")].split() if line else []

    both = ["--config.model.dropout_bits=32", "--config.model.last_layer_rows=all"]
    assert flags({}) == both                                            # before both keys
    assert flags({"dropout_bits": 32}) == both                          # recorded, default changed since
    assert flags({"dropout_bits": 16}) == both[1:]
    assert flags({"dropout_bits": 16, "last_layer_rows": "predicted"}) == []
    assert flags({}, ("clm",)) == both[:1]                              # a decoder has no predicted rows
    assert flags({}, ("clm", "mlm")) == both
    assert flags({}, command="python -m launch compare --config.model.dropout_bits=32") == both[1:]
    assert flags({"last_layer_rows": "all", "dropout_bits": 16}) == both[1:]
