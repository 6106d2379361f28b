"""Documents that are generated from data: the README's findings table equals what tools/findings_table.py builds
from the committed docs/experiments/*/report.json, and every report it cites exists; every benchmark result cited
is committed with its command; every patch of a lever not kept applies at the commit its index names."""
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import findings_table  # noqa: E402
import probe_sweep  # noqa: E402


def test_readme_findings_table_is_generated_from_the_reports():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    block = text.split(findings_table.BEGIN, 1)[1].split(findings_table.END, 1)[0]
    assert block.strip() == findings_table.table().strip(), "run: python tools/findings_table.py --write"
    for link in re.findall(r"\]\((docs/experiments/[^)]+)\)", block):
        assert os.path.isfile(os.path.join(ROOT, link)), link


@pytest.mark.parametrize("folder", ["probe-sweep", "probe-sweep/long", "probe-sweep/alibi"])
def test_the_probe_sweep_reports_are_generated_from_their_json(folder):
    """README quotes docs/experiments/probe-sweep*/REPORT.md: each is what `tools/probe_sweep.py --render` makes of
    the sweep.json beside it, whose summary is the mean and std of its runs' cells."""
    import json  # pylint: disable=import-outside-toplevel
    path = os.path.join(ROOT, "docs", "experiments", folder)
    with open(os.path.join(path, "sweep.json"), encoding="utf-8") as f:
        result = json.load(f)
    assert result["summary"] == probe_sweep.summary(result["runs"])
    with open(os.path.join(path, "REPORT.md"), encoding="utf-8") as f:
        assert f.read() == probe_sweep.markdown(result), f"run: python tools/probe_sweep.py --render --out={path}"


def test_one_finding_read_by_two_suites_is_one_row_as_far_as_the_table_prints(tmp_path):
    """The probe suite's runs were retrained to within 1e-7 of the extrapolation suite's: the NoPos perplexity
    finding, equal to the 4 places printed, was listed twice. A difference the table shows keeps both rows."""
    import json  # pylint: disable=import-outside-toplevel

    def publish(suite, per_seed):
        part = {"comparison": "x − y", "per_seed": per_seed, "mean": 0.1, "std": 0.01, "unit": "nats",
                "verdict": "reproduced"}
        report = {"config": {"model": {"num_layers": 2, "hidden_size": 8, "max_len": 16},
                             "train": {"steps": 10, "batch_size": 2}}, "seeds": [0, 1, 2],
                  "findings": [{"claim": "c", "paper": "p", "verdict": "reproduced", "parts": [part]}]}
        folder = tmp_path / "docs" / "experiments" / suite
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "report.json").write_text(json.dumps(report))

    publish("probe", {"0": 0.10001, "1": 0.2, "2": 0.3})
    publish("extrapolation", {"0": 0.1000101, "1": 0.2, "2": 0.3})
    assert findings_table.table(str(tmp_path)).count("| c (p)") == 1
    publish("extrapolation", {"0": 0.1002, "1": 0.2, "2": 0.3})
    assert findings_table.table(str(tmp_path)).count("| c (p)") == 2


def test_replace_block_refuses_a_readme_without_markers():
    try:
        findings_table.replace_block("no markers here", "x")
    except SystemExit as err:
        assert str(err).startswith("error: no <!-- findings:begin -->")
    else:
        raise AssertionError("expected SystemExit")
    assert findings_table.replace_block(f"a {findings_table.BEGIN}\nold\n{findings_table.END} b", "new\n") == \
        f"a {findings_table.BEGIN}\nnew\n{findings_table.END} b"


def test_the_script_prints_the_table():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "findings_table.py")], capture_output=True,
                         text=True, check=True).stdout
    assert out.startswith(("Scale of every run in the table:", "Scales of the runs in the table")), out[:200]
    assert "| finding (paper) |" in out and "| steps |" in out
    # with several scales, each is listed in the head line and each row says its steps
    assert out.count("2L/d128, 1500 steps") == 1 and out.count("5000 steps = 10.2M tokens") == 1


def test_every_benchmark_result_cited_exists_and_names_its_command():
    """Each `results_*.json` that README.md or a heading of benchmarks/RESULTS.md names (the headings carry the
    commands; the body may also name the outputs of scripts not yet run) is committed under benchmarks/, is JSON
    and, where it records the command that made it, that command writes to this very file."""
    import json  # pylint: disable=import-outside-toplevel
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        texts = [f.read()]
    with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), encoding="utf-8") as f:
        texts.append("\n".join(line for line in f if line.startswith("#")))
    cited = {name for text in texts for name in re.findall(r"\b(results_[A-Za-z0-9_]+\.json)\b", text)}
    assert len(cited) >= 10
    for name in sorted(cited):
        path = os.path.join(ROOT, "benchmarks", name)
        assert os.path.isfile(path), f"{name} is cited but not in benchmarks/"
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        command = data.get("command") if isinstance(data, dict) else None
        if command and "--json" in command:
            assert command.rstrip().endswith(name) or f"{name} " in command, (name, command)


def test_every_tried_patch_is_listed_and_applies_at_its_commit():
    """benchmarks/tried/README.md names, for each patch there, the commit it applies to (RESULTS.md's `git apply`
    instructions rely on it): every patch is listed once, and `git apply --check` against that commit's tree (a
    scratch index, nothing checked out) accepts it. Skipped outside a git clone with that history."""
    folder = os.path.join(ROOT, "benchmarks", "tried")
    with open(os.path.join(folder, "README.md"), encoding="utf-8") as f:
        listed = re.findall(r"^\| `([\w.]+\.patch)` \| ([0-9a-f]{7,40}) \|", f.read(), re.M)
    patches = sorted(name for name in os.listdir(folder) if name.endswith(".patch"))
    assert sorted(name for name, _ in listed) == patches
    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("not a git clone")
    for name, commit in listed:
        if subprocess.run(["git", "cat-file", "-e", f"{commit}^{{tree}}"], cwd=ROOT, capture_output=True).returncode:
            pytest.skip(f"{commit} is not in this clone's history")
        with tempfile.TemporaryDirectory() as scratch:
            env = dict(os.environ, GIT_INDEX_FILE=os.path.join(scratch, "index"))
            subprocess.run(["git", "read-tree", commit], cwd=ROOT, env=env, check=True, capture_output=True)
            check = subprocess.run(["git", "apply", "--cached", "--check", os.path.join(folder, name)], cwd=ROOT,
                                   env=env, capture_output=True, text=True)
            assert check.returncode == 0, (name, commit, check.stderr)


def test_the_scheme_lists_of_the_docs_name_every_scheme():
    """A scheme added to tupe_jax/positional must get its README row and its place in configs/pretrain.py's list
    (the steps: README, "Adding a positional scheme")."""
    from tupe_jax.positional import SCHEMES  # pylint: disable=import-outside-toplevel
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        table = f.read().split("| `pe=` |", 1)[1].split("\n\n", 1)[0]      # the table's rows, to its blank line
    rows = re.findall(r"^\| `(\w+)`", table, flags=re.M)
    assert sorted(rows) == sorted(SCHEMES), "README.md's scheme table: one row per tupe_jax.positional.SCHEMES"
    with open(os.path.join(ROOT, "configs", "pretrain.py"), encoding="utf-8") as f:
        line = next(x for x in f if x.startswith("Schemes (`pe=`):"))
    listed = [w.split(" ")[0] for w in line.split(":", 1)[1].strip().rstrip(".").split(", ")]
    assert listed == list(SCHEMES), "configs/pretrain.py's docstring: 'Schemes (`pe=`): ...' names every scheme"


FAKE_GCLOUD = """#!/bin/sh
# `gcloud storage cat gs://B/P ...`: the files $FAKE_BUCKET/B/P, a missing one said on stderr and skipped
shift 2
status=0
for url in "$@"; do
  if [ -f "$FAKE_BUCKET/${url#gs://}" ]; then cat "$FAKE_BUCKET/${url#gs://}"; else echo "$url: not found" >&2; status=1; fi
done
exit $status
"""


def test_the_tpu_relaunch_loop_stops_only_once_the_run_is_finished(tmp_path):
    """docs/tpu.md's loop wrote its `done` marker after any exit 0, and a preempted run exits 0: the loop ended
    after the first preemption. Its `finished` test (run here with a fake gcloud) asks for the final evaluation."""
    with open(os.path.join(ROOT, "docs", "tpu.md"), encoding="utf-8") as f:
        doc = f.read()
    function = re.search(r"^finished\(\) \{.*?^\}$", doc, re.S | re.M).group(0)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "gcloud").write_text(FAKE_GCLOUD)
    (tmp_path / "bin" / "gcloud").chmod(0o755)
    run = tmp_path / "bucket" / "b" / "tupe_r"
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", FAKE_BUCKET=str(tmp_path / "bucket"),
               BUCKET="b")

    def finished():
        return subprocess.run(["bash", "-c", function + "\nfinished"], env=env, capture_output=True).returncode == 0

    assert not finished()                                            # not started
    run.mkdir(parents=True)
    (run / "config.json").write_text('{\n  "train": {\n    "steps": 6\n  }\n}\n')
    rows = ['{"loss": 2.0, "step": 3}', '{"eval_loss": 1.0, "split": "validation", "step": 6}']
    (run / "metrics.jsonl").write_text("\n".join(rows) + "\n")      # preempted at 3; an `evaluate` row
    assert not finished()
    (run / "metrics.jsonl").write_text("\n".join(rows + ['{"loss": 1.5, "step": 6}', '{"eval_loss": 1.2, "step": 6}'])
                                       + "\n")
    assert finished()
