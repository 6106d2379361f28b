"""The PNGs of a comparison suite's report (`analysis.report`): validation-loss curves, per-scheme lines over
evaluation lengths or layers, GLUE bars; every seed shown, written atomically (`plots.save_figure`)."""
from __future__ import annotations

import math
from typing import Optional

from tupe_jax import plots

GLUE_NAMES = {"cola": "CoLA (MCC)", "sst2": "SST-2 (acc)", "mrpc": "MRPC (acc)", "stsb": "STS-B (Pearson)",
              "qqp": "QQP (acc)", "mnli": "MNLI-m (acc)", "qnli": "QNLI (acc)", "rte": "RTE (acc)",
              "wnli": "WNLI (acc)", "wordorder": "word order (acc)"}
COLORS = plots.plt.rcParams["axes.prop_cycle"].by_key()["color"]


def runs_by_seed(scheme: dict) -> list[dict]:
    """A scheme's per-seed runs, in seed order."""
    return [scheme["seeds"][k] for k in sorted(scheme["seeds"], key=int)]


def loss_curves(report: dict, path: str) -> str:
    """Validation loss vs step per objective; one thin line per seed, the mean over seeds thick."""
    objectives = sorted({s["objective"] for s in report["schemes"]})
    fig, axes = plots.plt.subplots(1, len(objectives), figsize=(6.2 * len(objectives), 3.8), squeeze=False)
    for ax, objective in zip(axes[0], objectives):
        for i, s in enumerate(x for x in report["schemes"] if x["objective"] == objective):
            color, by_step = COLORS[i % len(COLORS)], {}
            for run in runs_by_seed(s):
                ax.plot([r["step"] for r in run["eval"]], [r["eval_loss"] for r in run["eval"]], color=color,
                        alpha=0.35, linewidth=0.8)
                for r in run["eval"]:
                    by_step.setdefault(r["step"], []).append(r["eval_loss"])
            steps = sorted(by_step)
            ax.plot(steps, [sum(by_step[k]) / len(by_step[k]) for k in steps], color=color, linewidth=2,
                    label=s["label"])
        ax.set_title(f"{'MLM' if objective == 'mlm' else 'causal LM'}: validation loss "
                     f"({len(report['seeds'])} seeds: thin, mean: thick)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return plots.save_figure(fig, path)


def per_scheme_plot(report: dict, path: str, series: dict[str, list[tuple[list, list]]], xlabel: str, ylabel: str,
                     title: str, log_y: bool = False, hline: Optional[float] = None,
                     hline2: Optional[float] = None) -> str:
    """One thin line per seed and scheme (same colour per scheme); dashed `hline`: chance, dotted `hline2`: the
    median constant."""
    fig, ax = plots.plt.subplots(figsize=(6.8, 4.0))
    for i, (name, lines) in enumerate(series.items()):
        for j, (xs, ys) in enumerate(lines):
            ax.plot(xs, ys, marker="o", markersize=3, color=COLORS[i % len(COLORS)], alpha=0.7,
                    label=name if j == 0 else None)
    if hline is not None:
        ax.axhline(hline, color="gray", linestyle="--", label="chance")
    if hline2 is not None:
        ax.axhline(hline2, color="gray", linestyle=":", label="median constant")
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return plots.save_figure(fig, path)


def glue_plot(report: dict, path: str) -> str:
    """Bars: mean dev score over seeds per (scheme, task); dots: every seed."""
    tasks, names = report["glue_tasks"], list(report["glue"])
    fig, ax = plots.plt.subplots(figsize=(max(6.0, 1.5 * len(tasks)), 3.8))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        for k, task in enumerate(tasks):
            scores = [100 * v for r in report["glue"][name].values()     # a missing score is no bar of 0
                      for v in [r.get(task, {}).get("score")] if v is not None and math.isfinite(v)]
            x = k + i * width
            ax.bar(x, sum(scores) / len(scores) if scores else 0.0, width, color=COLORS[i % len(COLORS)], alpha=0.6,
                   label=name if k == 0 else None)
            ax.scatter([x] * len(scores), scores, color="black", s=6, zorder=3)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(tasks))], [GLUE_NAMES.get(t, t) for t in tasks], fontsize=7)
    ax.set_ylabel("dev score x 100")
    ax.set_title(f"fine-tuning: mean over {len(report['seeds'])} seeds (bars), each seed (dots)")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    return plots.save_figure(fig, path)
