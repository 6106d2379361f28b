"""Documents that are generated from data: the README's findings table equals what tools/findings_table.py builds
from the committed docs/experiments/*/report.json, and every report it cites exists."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import findings_table  # noqa: E402


def test_readme_findings_table_is_generated_from_the_reports():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    block = text.split(findings_table.BEGIN, 1)[1].split(findings_table.END, 1)[0]
    assert block.strip() == findings_table.table().strip(), "run: python tools/findings_table.py --write"
    for link in re.findall(r"\]\((docs/experiments/[^)]+)\)", block):
        assert os.path.isfile(os.path.join(ROOT, link)), link


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
