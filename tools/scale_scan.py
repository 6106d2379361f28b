"""Scale scan (issue: seeded reproductions, step 1): how validation MLM accuracy / loss and causal perplexity grow
with minutes of training on this machine, for two model shapes on WikiText-2.

    python tools/scale_scan.py [--data=../shared/data/wikitext-2] [--runs=runs/scan] \
        [--out=docs/experiments/scale] [--only=tiny-bert_a-mlm,...]

Trains (or reuses, when finished) one long `launch pretrain` run per (shape, scheme, objective) below, then writes
`scan.json` (every validation row with the training minutes spent to reach it) and `scan.png`. Minutes are the
training steps' own time (`step_time_s` in metrics.jsonl: no compile, evaluation or checkpointing). One long run
per curve: the learning rate decays over the whole run, so a point at minute t is what a longer schedule had
reached at t — a slight underestimate of what a run with budget t would reach.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# shape -> (configs/pretrain.py size, batch, learning rate, warmup, eval_every)
SHAPES = {
    "tiny": ("tiny", 16, 1e-3, 100, 250),      # 2 layers, d 128, 2 heads, MLP 512, vocab 2048
    "small": ("small", 16, 5e-4, 100, 100),    # 4 layers, d 256, 4 heads, MLP 1024, vocab 8192
}
# run -> steps (batch 16 x 128 tokens: 1000 steps = 2.05M tokens); the small shape is ~4x the compute per token
RUNS = {"tiny-bert_a-mlm": 5000, "tiny-nopos-mlm": 5000, "tiny-bert_a-clm": 3000, "small-bert_a-mlm": 2000,
        "small-nopos-mlm": 2000, "small-bert_a-clm": 1500}


def command(name: str, data: str, runs: str) -> list[str]:
    shape, pe, objective = name.split("-")
    size, batch, lr, warmup, every = SHAPES[shape]
    steps = RUNS[name]
    return [sys.executable, "-m", "launch", "pretrain", f"--config=configs/pretrain.py:pe={pe},size={size},"
            f"objective={objective}", f"--workdir={os.path.join(runs, name)}", "--config.data.name=wikitext",
            f"--config.data.path={data}", f"--config.train.steps={steps}", f"--config.train.batch_size={batch}",
            f"--config.train.learning_rate={lr}", f"--config.train.warmup_steps={warmup}",
            f"--config.train.eval_every={every}", "--config.train.eval_steps=20", "--config.train.log_every=25",
            "--config.model.dropout_bits=32",    # as the committed curves (made before 16-bit masks were the default)
            f"--config.checkpoint.every={steps}"]


def curve(path: str) -> list[dict]:
    """Validation rows of one run, each with `minutes`: the training time spent up to that step (the run's history
    as `read_metrics` gives it, redone steps once; rows a later `launch evaluate` added are not its curve)."""
    from tupe_jax.metrics import read_metrics  # pylint: disable=import-outside-toplevel
    rows = [r for r in read_metrics(path) if "split" not in r]
    seconds, prev, at = 0.0, 0, {}
    for r in rows:
        if "step_time_s" in r and int(r["step"]) > prev:
            seconds += float(r["step_time_s"]) * (int(r["step"]) - prev)
            prev = int(r["step"])
        at[int(r["step"])] = seconds
    out = []
    for r in rows:
        if "eval_loss" in r:
            step = int(r["step"])
            known = [s for s in at if s <= step]
            row = {"step": step, "minutes": (at[max(known)] if known else 0.0) / 60}
            row.update({k: v for k, v in r.items() if k.startswith("eval_")})
            out.append(row)
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, run in result["runs"].items():
        xs = [r["minutes"] for r in run["curve"]]
        if name.endswith("-mlm"):
            axes[0].plot(xs, [r["eval_mlm_accuracy"] for r in run["curve"]], label=name)
            axes[1].plot(xs, [r["eval_loss"] for r in run["curve"]], label=name)
        else:
            axes[2].plot(xs, [r["eval_perplexity"] if "eval_perplexity" in r else 2.718281828 ** r["eval_loss"]
                              for r in run["curve"]], label=name)
    for ax, title in zip(axes, ("validation MLM accuracy", "validation MLM loss", "validation perplexity (causal)")):
        ax.set_xlabel("training minutes (this machine)")
        ax.set_title(title)
        ax.legend()
    axes[2].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def markdown(result: dict) -> str:
    """REPORT.md: each curve at a few points, and BERT-A vs NoPos (MLM) at equal steps for each shape."""
    lines = ["# Scale scan", "", f"Command: `{result['command']}` (each run's own command is in scan.json). "
             "Minutes: the training steps' own time on this machine (2 CPU cores, shared with other jobs while "
             "these ran, so minutes overstate the compute; tokens do not). ![scan](scan.png)", "",
             "| run | step | M tokens | minutes | val loss | MLM acc / ppl |", "|---|---|---|---|---|---|"]
    for name, run in result["runs"].items():
        curve_rows = run["curve"]
        picks = sorted({curve_rows[int(f * (len(curve_rows) - 1))]["step"] for f in (0, 0.25, 0.5, 0.75, 1.0)}) \
            if curve_rows else []
        for r in (r for r in curve_rows if r["step"] in picks):
            extra = (f"acc {r['eval_mlm_accuracy']:.3f}" if "eval_mlm_accuracy" in r
                     else f"ppl {r.get('eval_perplexity', 2.718281828 ** r['eval_loss']):.1f}")
            lines.append(f"| {name} | {r['step']} | {r['step'] * 16 * 128 / 1e6:.1f} | {r['minutes']:.1f} | "
                         f"{r['eval_loss']:.3f} | {extra} |")
    done = {n: (r["curve"][-1]["step"] if r["curve"] else 0) for n, r in result["runs"].items()}
    lines += ["", "Status: " + "; ".join(
        f"{n} {'complete' if done.get(n, 0) >= steps else (f'stopped at step {done[n]} of {steps}' if n in done else 'not run')}"
        for n, steps in RUNS.items()) + ("." if all(done.get(n, 0) >= s for n, s in RUNS.items()) else
                                         " (rerun the command to continue: finished runs are reused).")]
    for shape in SHAPES:
        a, b = result["runs"].get(f"{shape}-bert_a-mlm"), result["runs"].get(f"{shape}-nopos-mlm")
        if not (a and b):
            continue
        nopos = {r["step"]: r["eval_loss"] for r in b["curve"]}
        both = [(r["step"], nopos[r["step"]] - r["eval_loss"]) for r in a["curve"] if r["step"] in nopos]
        if both:
            lines += ["", f"{shape}: validation MLM loss NoPos − BERT-A at equal steps (positive = BERT-A ahead, "
                      "i.e. the model uses word order; one seed):", "",
                      " | ".join(f"{st}: {d:+.3f}" for st, d in both)]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="../shared/data/wikitext-2")
    p.add_argument("--runs", default="runs/scan")
    p.add_argument("--out", default="docs/experiments/scale")
    p.add_argument("--only", default="", help="comma-separated subset of " + ",".join(RUNS))
    p.add_argument("--report_only", action="store_true", help="train nothing; write the files from what exists")
    args = p.parse_args()
    names = [n for n in args.only.split(",") if n] or list(RUNS)
    for n in names:
        if n not in RUNS:
            sys.exit(f"error: unknown run {n!r}, --only, use some of {','.join(RUNS)}")
    for i, name in enumerate([] if args.report_only else names, 1):
        cmd = command(name, args.data, args.runs)
        done = curve(os.path.join(ROOT, args.runs, name)) if os.path.isfile(
            os.path.join(ROOT, args.runs, name, "metrics.jsonl")) else []
        if done and done[-1]["step"] >= RUNS[name]:
            print(f"[scan {i}/{len(names)}] {name}: complete, reused", flush=True)
            continue
        print(f"[scan {i}/{len(names)}] {name}: {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
    result = {"command": "python tools/scale_scan.py " + " ".join(sys.argv[1:]), "shapes": SHAPES,
              "runs": {n: {"command": "python " + " ".join(command(n, args.data, args.runs)[1:]),
                           "curve": curve(os.path.join(ROOT, args.runs, n))}
                       for n in RUNS if os.path.isfile(os.path.join(ROOT, args.runs, n, "metrics.jsonl"))}}
    out = os.path.join(ROOT, args.out)     # like --runs and --data: relative to the checkout, not the cwd
    refuse_to_shrink(result, out, args.runs)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "scan.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(out, "scan.png"))
    with open(os.path.join(out, "REPORT.md"), "w") as f:
        f.write(markdown(result))
    print(f"wrote {args.out}/scan.json, scan.png and REPORT.md", flush=True)


def refuse_to_shrink(result: dict, out: str, runs: str) -> None:
    """A scan with no runs, or without runs the scan.json in `out` has (a fresh clone has no runs/scan: the
    committed docs/experiments/scale would be replaced by an empty scan), writes nothing."""
    if not result["runs"]:
        sys.exit(f"error: no runs with metrics.jsonl under {runs}, --runs, train them first (drop --report_only) "
                 "or point --runs at them; nothing was written")
    path = os.path.join(out, "scan.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            lost = sorted(set(json.load(f).get("runs", {})) - set(result["runs"]))
        if lost:
            sys.exit(f"error: {path} has runs that {runs} lacks ({', '.join(lost)}), --runs, point --runs at the "
                     "scan's runs or give a fresh --out; nothing was written")


if __name__ == "__main__":
    main()
