"""Several bench_train runs read as one: each ratio's per-round values pooled, and the run medians side by side.

    python benchmarks/pool_runs.py RUN.json RUN.json [...] --json benchmarks/results_pooled_<machine>.json

One bench_train run gives each ratio as the median of its per-round ratios (ours and the peer timed in the same
round). On one shared VM that median drifts from run to run by as much as the margins issue #18 asks for. This
reads N runs of one shape and the same settings and reports, for every ratio all runs have:
- pooled: the median over every run's rounds, with min–max and the 95% order-statistic interval of `rounds.spread`.
  That interval takes the rounds as independent, which rounds of one run are not quite (they share the machine's
  state), so it is narrower than the drift between runs warrants;
- runs: each run's own median, and their min–max: how far the verdict moves between runs;
- for the ratios issue #18 sets a target on (`TARGETS`): whether the pooled median meets it and in how many runs
  the run's median does. "Holds" is read here as: met in every run.
`--plot PNG` draws one panel per target ratio: each run's rounds as dots, its median as a bar, the pooled median
and its interval as a band, the target's side shaded. A file that is not a bench_train result, a run given twice, a
run whose shape, settings or CPU differ from the first file's, or an output in a folder that does not exist is
refused before anything is written. Not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from outputs import missing_folder, write_json  # noqa: E402  pylint: disable=wrong-import-position
from rounds import spread  # noqa: E402  pylint: disable=wrong-import-position

# issue #18's must-show targets: ratio -> (lowest, highest) it may be
TARGETS = {
    "default: bert_a tokens/s / HF torch, its faster allocator": (1.5, None),
    "default: bert_a tokens/s / HF Flax, its faster allocator": (1.5, None),
    "equal work: bert_a@all tokens/s / HF torch, its faster allocator": (1.2, None),
    "equal work: bert_a@all tokens/s / HF Flax, its faster allocator": (1.2, None),
    "tupe_a step / bert_a step": (None, 1.03),
    "tupe_r step / bert_a step": (None, 1.03),
    "loop tokens/s / benchmark bert_a tokens/s": (0.95, 1.05),
}
# what must agree between pooled runs: the work each job does
SETTINGS = ("steps", "warmup", "predictions", "dropout", "backend", "equal_work", "default_predictions", "allocator",
            "allocator_ab", "peers_allocator_ab", "torch_threads")


class Refused(Exception):
    """A file the pool cannot take; the message is the one-line error."""


def meets(value: float, target: tuple) -> bool:
    """True when `value` lies within `target` = (lowest or None, highest or None)."""
    low, high = target
    return (low is None or value >= low) and (high is None or value <= high)


def load(path: str) -> dict:
    """One bench_train result file, checked to be one."""
    try:
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
    except (OSError, ValueError) as e:
        raise Refused(f"cannot read {path} as JSON ({e}), pass bench_train's --json files") from e
    if not isinstance(run, dict) or not all(k in run for k in ("ratios", "shape", "args", "started", "cpu")):
        raise Refused(f"{path} is not a bench_train result (no ratios, shape, args, started or cpu), "
                      "pass files written by benchmarks/bench_train.py --json")
    return run


def check_poolable(paths: list[str], runs: list[dict]) -> None:
    """Refused unless every run has the first one's shape, settings and CPU, and no run appears twice."""
    first, seen = runs[0], {}
    for path, run in zip(paths, runs):
        if run["started"] in seen:
            raise Refused(f"{path} is the run of {seen[run['started']]} again (both started {run['started']}), "
                          "pass each run once")
        seen[run["started"]] = path
        for what, mine, theirs in [("shape", run["shape"], first["shape"]), ("cpu", run["cpu"], first["cpu"])] + [
                (f"args.{k}", run["args"].get(k), first["args"].get(k)) for k in SETTINGS]:
            if mine != theirs:
                raise Refused(f"{path} has {what}={mine!r} where {paths[0]} has {theirs!r}, "
                              "pool only runs of one shape and settings on one CPU")


def pool(paths: list[str], runs: list[dict]) -> dict:
    """{ratio: {pooled, runs, run_medians_min, run_medians_max, target, pooled_meets, runs_meeting}} over the
    ratios every run has (module docstring)."""
    keys = [k for k in runs[0]["ratios"] if all(k in r["ratios"] for r in runs)]
    out = {}
    for key in keys:
        per_run = [r["ratios"][key]["per_round"] for r in runs]
        medians = [statistics.median(v) for v in per_run]
        entry = {"pooled": spread([x for v in per_run for x in v]),
                 "runs": [{"file": p, "started": r["started"], "rounds": len(v), "median": m}
                          for p, r, v, m in zip(paths, runs, per_run, medians)],
                 "run_medians_min": min(medians), "run_medians_max": max(medians), "target": TARGETS.get(key)}
        if key in TARGETS:
            entry["pooled_meets"] = meets(entry["pooled"]["median"], TARGETS[key])
            entry["runs_meeting"] = sum(meets(m, TARGETS[key]) for m in medians)
        out[key] = entry
    return out


def target_text(target) -> str:
    """'≥ 1.2', '≤ 1.03' or '0.95–1.05'."""
    low, high = target
    return f"≥ {low}" if high is None else f"≤ {high}" if low is None else f"{low}–{high}"


def plot(ratios: dict, runs: list[dict], path: str) -> None:
    """The target ratios' rounds, run medians and pooled interval, one panel each (module docstring), to `path`."""
    sys.path.insert(0, os.path.dirname(HERE))
    from tupe_jax.plots import plt, save_figure  # pylint: disable=import-outside-toplevel
    keys = [k for k in TARGETS if k in ratios]
    cols = min(4, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.9 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys):
        e, (low, high) = ratios[key], TARGETS[key]
        for i, r in enumerate(runs):
            values = r["ratios"][key]["per_round"]
            ax.plot([i] * len(values), values, ".", color="0.6", markersize=4)
            ax.plot([i - 0.3, i + 0.3], [e["runs"][i]["median"]] * 2, color="tab:blue", linewidth=2)
        p = e["pooled"]
        band = p["ci95"] or [p["median"], p["median"]]
        ax.axhspan(band[0], band[1], color="tab:blue", alpha=0.15)
        ax.axhline(p["median"], color="tab:blue", linestyle="--", linewidth=1)
        bottom, top = ax.get_ylim()
        for edge, far in ((low, bottom), (high, top)):
            if edge is not None:
                ax.axhline(edge, color="tab:red", linewidth=1)
                ax.axhspan(min(edge, far), max(edge, far), color="tab:red", alpha=0.06)
        ax.set_ylim(bottom, top)
        ax.set_xticks(range(len(runs)), [r["started"][5:16] for r in runs], rotation=60, fontsize=7)
        ax.set_title(key.replace(", its faster allocator", "").replace(": ", ":\n"), fontsize=8)
        ax.set_xlabel(f"target {target_text((low, high))}: met in {e['runs_meeting']} of {len(runs)} runs",
                      fontsize=8)
    fig.suptitle(f"{len(runs)} bench_train runs; blue: run medians, pooled median and 95% interval; "
                 "red: where the target is missed", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="bench_train --json files, two or more")
    ap.add_argument("--json", default="")
    ap.add_argument("--plot", default="", help="a PNG of the target ratios (module docstring)")
    args = ap.parse_args(argv)
    try:
        if len(args.runs) < 2:
            raise Refused(f"{len(args.runs)} run given on the command line, pass two or more bench_train files")
        for flag, out in (("--json", args.json), ("--plot", args.plot)):
            message = missing_folder(out, flag)
            if message:
                raise Refused(message)
            if out and os.path.realpath(out) in map(os.path.realpath, args.runs):
                raise Refused(f"{flag} {out} is one of the runs to pool, {flag}, name a new file (it would be "
                              "replaced)")
        if args.json and args.plot and os.path.realpath(args.json) == os.path.realpath(args.plot):
            raise Refused(f"--json and --plot both name {args.json}, --plot, name another file")
        runs = [load(p) for p in args.runs]
        check_poolable(args.runs, runs)
        ratios = pool(args.runs, runs)
        if args.plot and not any(k in ratios for k in TARGETS):
            raise Refused(f"--plot {args.plot} draws issue #18's target ratios and these runs share none of them, "
                          "drop --plot or pass runs of bench_train's default jobs")
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{len(runs)} runs, {runs[0]['cpu']}, shape {runs[0]['shape']}\n")
    print("| ratio | pooled median (95% interval; rounds) | run medians | target: pooled, runs meeting |\n"
          "|---|---|---|---|")
    for key, e in ratios.items():
        p = e["pooled"]
        ci = f"{p['ci95'][0]:.3f}–{p['ci95'][1]:.3f}" if p["ci95"] else "—"
        verdict = (f"{target_text(e['target'])}: {'met' if e['pooled_meets'] else 'missed'}, "
                   f"{e['runs_meeting']} of {len(runs)}" if e["target"] else "")
        print(f"| {key} | {p['median']:.3f}× ({ci}; {len(p['per_round'])}) | "
              f"{', '.join(format(r['median'], '.3f') for r in e['runs'])} | {verdict} |")
    if args.json:
        command = "python benchmarks/pool_runs.py " + shlex.join(sys.argv[1:] if argv is None else argv)
        print()
        write_json(args.json, {"command": command, "cpu": runs[0]["cpu"], "shape": runs[0]["shape"],
                               "settings": {k: runs[0]["args"].get(k) for k in SETTINGS},
                               "files": [{"file": p, "started": r["started"], "finished": r.get("finished"),
                                          "git_commit": r.get("git_commit"), "command": r.get("command")}
                                         for p, r in zip(args.runs, runs)],
                               "ratios": ratios})
    if args.plot:
        plot(ratios, runs, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
