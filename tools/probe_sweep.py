"""Probe-length sweep: do the absolute-position probes of `launch probe` converge? (README's NoPos probe verdict.)

    python tools/probe_sweep.py --workdir=runs/cmp/runs/nopos-clm-s0 --workdir=... \
        [--steps=300,1000,3000,10000,30000] [--train_tokens=16384,524288] [--batch_tokens=512] [--learning_rate=2e-3] \
        [--out=docs/experiments/probe-sweep]

For every run, the hidden states are collected once (the largest `--train_tokens`, drawn as `launch probe` draws
them; a smaller setting is the first windows of that draw, the very windows `launch probe` would take), then one
probe per layer is trained at every (steps, train_tokens) cell with `analysis/probe.py`'s `train_probes` and its
defaults otherwise (batch 512 tokens unless `--batch_tokens`, Adam lr 2e-3 cosine-decayed over the cell's steps,
4096 validation tokens).
The cell (300 steps, 16384 tokens, batch 512) is `launch probe`'s default (and was the compare suite's until session
44); the cell (30000 steps, 524288 tokens) is the compare suite's probe since, so it repeats the suite's probe
numbers for the same runs.

Writes `sweep.json` (every cell of every run), `sweep.png` (MAD / chance against probe steps, per layer) and
`REPORT.md` (mean ± std over the runs of one scheme, i.e. over seeds).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tupe_jax.analysis import common, probe as P  # noqa: E402  (after the path above)


def scheme_of(name: str) -> str:
    """The run's folder name without its seed suffix (`nopos-clm-s2` -> `nopos-clm`)."""
    head, _, tail = name.rpartition("-s")
    return head if head and tail.isdigit() else name


def sweep_run(run: common.Run, steps: list[int], train_tokens: list[int], base: P.ProbeSettings) -> dict:
    """Every (steps, train_tokens) cell for one run: the features once, then one probe fit per cell."""
    t0 = time.time()
    train_x, train_y = P.features(run, "train", max(train_tokens), base.seed)
    eval_x, eval_y = P.features(run, "validation", base.eval_tokens, base.seed + 1)
    per_window = run.model_cfg.max_len - P.first_position(run)
    n = run.model_cfg.max_len
    cells = []
    for tokens in train_tokens:
        kept = -(-tokens // run.model_cfg.max_len) * per_window    # whole windows, as `launch probe` rounds
        for s in steps:
            settings = dataclasses.replace(base, steps=s, train_tokens=tokens)
            layers = P.train_probes(train_x[:, :kept], train_y[:kept], eval_x, eval_y, n, settings)
            cells.append({"steps": s, "train_tokens": tokens, "tokens_used": kept, "layers": layers})
            mads = ", ".join(f"{x['mad']:.2f}" for x in layers)
            print(f"probe-sweep {run.name}: {tokens} tokens, {s} steps: MAD per layer [{mads}] "
                  f"({time.time() - t0:.0f} s)", flush=True)
    return {**run.describe(), "scheme": scheme_of(run.name), "num_classes": n,
            "first_position": P.first_position(run), "chance_mad": P.chance_mad(n - P.first_position(run)),
            "median_mad": P.median_mad(eval_y), "cells": cells,
            "median_mad_by_segment": P.segment_mads(np.full_like(eval_y, P.median_position(eval_y)), eval_y)}


def summary(runs: list[dict]) -> list[dict]:
    """Mean ± std over the runs of a scheme, per cell and layer, of MAD and MAD / chance."""
    out = []
    for scheme in dict.fromkeys(r["scheme"] for r in runs):
        group = [r for r in runs if r["scheme"] == scheme]
        for i, cell in enumerate(group[0]["cells"]):
            for layer in range(len(cell["layers"])):
                mads = np.array([r["cells"][i]["layers"][layer]["mad"] for r in group])
                frac = np.array([r["cells"][i]["layers"][layer]["mad"] / r["chance_mad"] for r in group])
                segs = np.array([[m for _, _, m in r["cells"][i]["layers"][layer].get("mad_by_segment", [])]
                                 for r in group])
                out.append({"mad_by_segment_mean": segs.mean(axis=0).tolist() if segs.size else None,
                            "scheme": scheme, "seeds": len(group), "steps": cell["steps"],
                            "train_tokens": cell["train_tokens"], "layer": layer,
                            "mad_mean": float(mads.mean()), "mad_std": float(mads.std(ddof=1)) if len(group) > 1
                            else None, "fraction_of_chance_mean": float(frac.mean()),
                            "fraction_of_chance_std": float(frac.std(ddof=1)) if len(group) > 1 else None})
    return out


def largest_cell(result: dict) -> tuple[int, int]:
    """(steps, train_tokens) of the longest probe on the most tokens: the sweep's best-trained probes."""
    return max(result["grid"]["steps"]), max(result["grid"]["train_tokens"])


def plot(result: dict, path: str) -> None:
    """Top: MAD / chance against probe steps, one panel per layer, a line per (scheme, train_tokens) with its std.
    Bottom: MAD by position range in the largest cell, a line per scheme, with the median constant's."""
    plt = common.pyplot()
    rows = result["summary"]
    layers = sorted({r["layer"] for r in rows})
    fig, axes = plt.subplots(2, len(layers), figsize=(4.6 * len(layers), 8.0), squeeze=False)
    steps, tokens = largest_cell(result)
    first = result["runs"][0]
    mids = [(a + b) / 2 for a, b, _ in first["median_mad_by_segment"]]
    for ax, layer in zip(axes[1], layers):
        for r in rows:
            if (r["steps"], r["train_tokens"], r["layer"]) == (steps, tokens, layer) and r["mad_by_segment_mean"]:
                ax.plot(mids, r["mad_by_segment_mean"], marker="o", label=r["scheme"])
        ax.plot(mids, [m for _, _, m in first["median_mad_by_segment"]], color="gray", linestyle=":",
                label="median constant")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("true position (range midpoint)")
        ax.set_title(f"layer {layer}: MAD by position, {steps} steps, {tokens} tokens", fontsize=9)
    axes[1][0].set_ylabel("probe MAD in the range (positions)")
    axes[1][-1].legend(fontsize=7)
    for ax, layer in zip(axes[0], layers):
        for scheme in dict.fromkeys(r["scheme"] for r in rows):
            for tokens in sorted({r["train_tokens"] for r in rows}):
                line = sorted((r for r in rows if r["scheme"] == scheme and r["train_tokens"] == tokens
                               and r["layer"] == layer), key=lambda r: r["steps"])
                ax.errorbar([r["steps"] for r in line], [r["fraction_of_chance_mean"] for r in line],
                            yerr=[r["fraction_of_chance_std"] or 0 for r in line], marker="o", capsize=3,
                            label=f"{scheme}, {tokens} tokens")
        ax.axhline(1.0, color="gray", linestyle="--", label="chance")
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("probe Adam steps")
        ax.set_title(f"layer {layer}" + (" (embedding output)" if layer == 0 else ""))
    axes[0][0].set_ylabel("probe MAD / chance MAD (lower = more position)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    common.save_figure(fig, path)


def markdown(result: dict) -> str:
    first = result["runs"][0]
    lines = ["# Probe-length sweep", "",
             f"Command: `{result['command']}`", "",
             "Each cell trains one 2-layer ReLU probe per layer (`analysis/probe.py`) for the given Adam steps on the "
             "given number of frozen training tokens; batch "
             f"{result['settings']['batch_tokens']} tokens, lr {result['settings']['learning_rate']} cosine-decayed, "
             f"{result['settings']['eval_tokens']} validation tokens. The cell (300 steps, 16384 tokens) is "
             f"`launch probe`'s default. Chance MAD {first['chance_mad']:.2f}, median constant {first['median_mad']:.2f} "
             f"({first['num_classes'] - first['first_position']} positions). Mean ± std over the runs of a scheme "
             f"(its seeds): {', '.join(r['name'] for r in result['runs'])}. ![sweep](sweep.png)", ""]
    rows = result["summary"]
    layers = sorted({r["layer"] for r in rows})
    lines += ["| scheme | train tokens | steps | " + " | ".join(f"layer {x} MAD" for x in layers) + " |",
              "|---|---|---|" + "---|" * len(layers)]
    keyed = {(r["scheme"], r["train_tokens"], r["steps"], r["layer"]): r for r in rows}
    for scheme, tokens, steps in dict.fromkeys((r["scheme"], r["train_tokens"], r["steps"]) for r in rows):
        cells = [keyed[(scheme, tokens, steps, x)] for x in layers]
        lines.append(f"| `{scheme}` | {tokens} | {steps} | " + " | ".join(
            f"{c['mad_mean']:.1f}" + (f" ± {c['mad_std']:.1f}" if c["mad_std"] is not None else "")
            for c in cells) + " |")
    steps, tokens = largest_cell(result)
    segments = first["median_mad_by_segment"]
    lines += ["", f"MAD by true position in the largest cell ({steps} steps, {tokens} tokens), mean over the runs "
              "of a scheme; the median constant's MAD in the same range for comparison:", "",
              "| scheme | layer | " + " | ".join(f"{a}–{b}" for a, b, _ in segments) + " |",
              "|---|---|" + "---|" * len(segments),
              "| median constant | | " + " | ".join(f"{m:.1f}" for _, _, m in segments) + " |"]
    for r in rows:
        if (r["steps"], r["train_tokens"]) == (steps, tokens) and r["mad_by_segment_mean"]:
            lines.append(f"| `{r['scheme']}` | {r['layer']} | " + " | ".join(f"{m:.1f}" for m in
                                                                             r["mad_by_segment_mean"]) + " |")
    return "\n".join(lines) + "\n"


def parse_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        sys.exit(f"error: {flag}={text} is not a list of positive integers, {flag}, give e.g. {flag}=300,1000")
    return values


def write_outputs(result: dict, out: str) -> None:
    """sweep.json, sweep.png and REPORT.md in `out`."""
    os.makedirs(out, exist_ok=True)
    common.write_json(os.path.join(out, "sweep.json"), result)
    render(result, out)


def render(result: dict, out: str) -> None:
    """sweep.png and REPORT.md from a sweep's result (`--render`: from `out`'s sweep.json, no compute)."""
    plot(result, os.path.join(out, "sweep.png"))
    with open(os.path.join(out, "REPORT.md"), "w", encoding="utf-8") as f:
        f.write(markdown(result))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", action="append", default=[], help="a causal or MLM pretraining run (repeat)")
    p.add_argument("--steps", default="300,1000,3000,10000,30000")
    p.add_argument("--train_tokens", default="16384,524288")
    p.add_argument("--batch_tokens", type=int, default=P.ProbeSettings().batch_tokens, help="tokens per Adam step")
    p.add_argument("--learning_rate", type=float, default=P.ProbeSettings().learning_rate, help="peak Adam lr")
    p.add_argument("--out", default="docs/experiments/probe-sweep")
    p.add_argument("--render", action="store_true", help="redraw sweep.png and REPORT.md from --out's sweep.json")
    args = p.parse_args(argv)
    if args.render:
        path = os.path.join(args.out, "sweep.json")
        if args.workdir or not os.path.isfile(path):
            sys.exit(f"error: --render redraws {path} and trains nothing, --render, " + (
                "drop the --workdir flags" if args.workdir else "point --out at a folder holding a sweep.json"))
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
        render(result, args.out)
        print(f"probe-sweep: redrew sweep.png and REPORT.md in {args.out}", flush=True)
        return result
    if not args.workdir:
        sys.exit("error: no run to probe, --workdir, give one --workdir per pretraining run")
    steps, tokens = parse_ints(args.steps, "--steps"), parse_ints(args.train_tokens, "--train_tokens")
    if args.batch_tokens < 1:
        sys.exit(f"error: --batch_tokens={args.batch_tokens} must be positive, --batch_tokens, give e.g. 512")
    if not args.learning_rate > 0:
        sys.exit(f"error: --learning_rate={args.learning_rate} must be positive, --learning_rate, give e.g. 2e-3")
    runs = common.load_runs(args.workdir)          # refuses a run given twice before any compute
    base = P.ProbeSettings(batch_tokens=args.batch_tokens, learning_rate=args.learning_rate)
    result = {"command": "python tools/probe_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "settings": dataclasses.asdict(base), "grid": {"steps": steps, "train_tokens": tokens}, "runs": []}
    for i, run in enumerate(runs, 1):
        print(f"[probe-sweep {i}/{len(runs)}] {run.name}", flush=True)
        result["runs"].append(sweep_run(run, steps, tokens, base))
    result["summary"] = summary(result["runs"])
    write_outputs(result, args.out)
    print(f"probe-sweep: wrote sweep.json, sweep.png and REPORT.md to {args.out}", flush=True)
    return result


if __name__ == "__main__":
    main()
