"""The README's findings table, generated from the committed reports: `python tools/findings_table.py [--write]`.

Reads docs/experiments/<suite>/report.json (written by `python -m launch compare`, copied by
`tools/run_experiments.sh publish`) and prints one row per finding and comparison: the claim, the per-seed paired
differences as mean ± std, the number of seeds and the verdict of tupe_jax/analysis/findings.py. With --write it
replaces the block between `<!-- findings:begin -->` and `<!-- findings:end -->` in README.md
(tests/test_docs.py checks that the README holds exactly what this prints).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)                    # run as `python tools/findings_table.py` from a checkout
from tupe_jax.analysis.findings import mean_spread  # noqa: E402  pylint: disable=wrong-import-position
SUITES = ("probe", "nopos-mlm", "nopos-mlm-5k", "extrapolation", "tupe", "tupe-a-5k")
BEGIN, END = "<!-- findings:begin -->", "<!-- findings:end -->"


class Refused(Exception):
    """A report the table cannot be made from, or a README block it would shrink: one line, exit 2."""


def _report(root: str, suite: str) -> dict | None:
    """docs/experiments/<suite>/report.json, None when the suite has none; unreadable JSON is refused."""
    path = os.path.join(root, "docs", "experiments", suite, "report.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, ValueError) as err:
        raise Refused(f"error: cannot read {path} ({type(err).__name__}: {str(err)[:80]}), {path}, rerun "
                      f"`tools/run_experiments.sh {suite} publish` or restore it with git") from None
    if not isinstance(report, dict):
        raise Refused(f"error: {path} is not a compare report (a JSON object), {path}, restore it with git")
    return report


def _scale(report: dict) -> str:
    c = report["config"]
    m, t = c["model"], c["train"]
    tokens = t["steps"] * t["batch_size"] * m["max_len"] / 1e6
    return (f"{m['num_layers']}L/d{m['hidden_size']}, {t['steps']} steps = {tokens:.1f}M tokens, "
            f"seeds {','.join(map(str, report['seeds']))}")


def scales(root: str = ROOT) -> list[str]:
    """One line per distinct run scale of the reports in the table."""
    out = []
    for suite in SUITES:
        report = _report(root, suite)
        if report is not None:
            line = _guarded(suite, _scale, report)
            if line not in out:
                out.append(line)
    return out


def _guarded(suite: str, fn, *args):
    """`fn(*args)`, with a report lacking a key (or holding another type) refused in one line naming it."""
    try:
        return fn(*args)
    except (KeyError, TypeError, ValueError, IndexError) as err:
        path = os.path.join("docs", "experiments", suite, "report.json")
        raise Refused(f"error: {path} lacks what the table reads ({type(err).__name__}: {str(err)[:80]}), {path}, "
                      f"rerun `tools/run_experiments.sh {suite} publish` or restore it with git") from None


def table(root: str = ROOT) -> str:
    rows = ["| finding (paper) | comparison (per-seed paired difference) | mean ± std | seeds | steps | verdict | report |",
            "|---|---|---|---|---|---|---|"]
    seen = set()
    for suite in SUITES:
        report = _report(root, suite)
        if report is not None:
            rows += _guarded(suite, _rows, report, suite, seen)
    found = scales(root)
    lead = "Scale of every run in the table: " if len(found) == 1 else \
        "Scales of the runs in the table (the steps column tells the rows apart): "
    head = [lead + "; ".join(found) + ".", ""] if found else []
    return "\n".join(head + rows) + "\n"


def _printed(per_seed: dict) -> dict:
    """Per-seed values to the 4 places the table prints: two suites' readings of the same runs, one retrained
    since to within float rounding (1e-7), are one row."""
    return {seed: round(x, 4) if isinstance(x, float) else x for seed, x in per_seed.items()}


def _rows(report: dict, suite: str, seen: set) -> list[str]:
    rows = []
    for finding in report.get("findings", []):
            key = (finding["claim"], json.dumps([_printed(p["per_seed"]) for p in finding["parts"]], sort_keys=True))
            if key in seen:    # the same runs analysed by two suites (e.g. NoPos perplexity), as far as printed
                continue
            seen.add(key)
            for i, part in enumerate(finding["parts"]):
                claim = f"{finding['claim']} ({finding['paper']}): **{finding['verdict']}**" if i == 0 else ""
                rows.append(f"| {claim} | {part['comparison']} | {mean_spread(part)} "
                            f"{part['unit']} | {len(part['per_seed'])} | {report['config']['train']['steps']} | "
                            f"{part['verdict']} | "
                            f"[{suite}](docs/experiments/{suite}/REPORT.md) |")
    return rows


def linked_suites(block: str) -> set[str]:
    """The suites whose reports a table links to."""
    return {s for s in SUITES if f"(docs/experiments/{s}/REPORT.md)" in block}


def replace_block(text: str, block: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"error: no {BEGIN} ... {END} block, README.md, add the two markers where the table goes")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + BEGIN + "\n" + block + END + tail


def main(root: str = ROOT) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="replace the block in README.md")
    args = p.parse_args()
    try:
        block = table(root)
        missing = [s for s in SUITES if not os.path.isfile(os.path.join(root, "docs", "experiments", s, "report.json"))]
        if not args.write:
            if missing:
                print(f"warning: no report for {', '.join(missing)} in docs/experiments/: their rows are left out",
                      file=sys.stderr)
            sys.stdout.write(block)
            return 0
        readme = os.path.join(root, "README.md")
        with open(readme, encoding="utf-8") as f:
            text = f.read()
        new = replace_block(text, block)
        lost = sorted(linked_suites(text.split(BEGIN, 1)[1].split(END, 1)[0]) - linked_suites(block))
        if lost:
            raise Refused(f"error: the README's findings table has rows of {', '.join(lost)}, whose report.json is "
                          f"missing from docs/experiments/, README.md (left as it was), restore the report (git) or "
                          f"rerun `tools/run_experiments.sh {' '.join(lost)} publish`")
    except Refused as err:
        print(err, file=sys.stderr)
        return 2
    tmp = readme + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(new)
    os.replace(tmp, readme)
    print("wrote the findings table into README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
