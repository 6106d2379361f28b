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
SUITES = ("probe", "nopos-mlm", "nopos-mlm-5k", "extrapolation", "tupe")
BEGIN, END = "<!-- findings:begin -->", "<!-- findings:end -->"


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
        path = os.path.join(root, "docs", "experiments", suite, "report.json")
        if os.path.isfile(path):
            with open(path) as f:
                line = _scale(json.load(f))
            if line not in out:
                out.append(line)
    return out


def table(root: str = ROOT) -> str:
    rows = ["| finding (paper) | comparison (per-seed paired difference) | mean ± std | seeds | steps | verdict | report |",
            "|---|---|---|---|---|---|---|"]
    seen = set()
    for suite in SUITES:
        path = os.path.join(root, "docs", "experiments", suite, "report.json")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            report = json.load(f)
        for finding in report.get("findings", []):
            key = (finding["claim"], json.dumps([p["per_seed"] for p in finding["parts"]], sort_keys=True))
            if key in seen:                  # the same runs analysed by two suites (e.g. NoPos perplexity)
                continue
            seen.add(key)
            for i, part in enumerate(finding["parts"]):
                claim = f"{finding['claim']} ({finding['paper']}): **{finding['verdict']}**" if i == 0 else ""
                rows.append(f"| {claim} | {part['comparison']} | {mean_spread(part)} "
                            f"{part['unit']} | {len(part['per_seed'])} | {report['config']['train']['steps']} | "
                            f"{part['verdict']} | "
                            f"[{suite}](docs/experiments/{suite}/REPORT.md) |")
    found = scales(root)
    lead = "Scale of every run in the table: " if len(found) == 1 else \
        "Scales of the runs in the table (the steps column tells the rows apart): "
    head = [lead + "; ".join(found) + ".", ""] if found else []
    return "\n".join(head + rows) + "\n"


def replace_block(text: str, block: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"error: no {BEGIN} ... {END} block, README.md, add the two markers where the table goes")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + BEGIN + "\n" + block + END + tail


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="replace the block in README.md")
    args = p.parse_args()
    block = table()
    if not args.write:
        sys.stdout.write(block)
        return 0
    readme = os.path.join(ROOT, "README.md")
    with open(readme) as f:
        text = f.read()
    new = replace_block(text, block)
    with open(readme, "w") as f:
        f.write(new)
    print("wrote the findings table into README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
