"""GLUE metrics (scikit-learn / scipy), each task's headline number, the TUPE-paper GLUE average, and the
GLUE-server submission files.

Per task (dev sets; all numbers in [0, 1] here, x100 in tables):
  cola   matthews_corr (headline)                  mrpc, qqp   accuracy (headline), f1
  stsb   pearson (headline), spearman              mnli        accuracy (matched, headline), accuracy_mm
  others accuracy
The headline numbers follow the TUPE paper (Table 1: "MCC for CoLA, Pearson for STS-B, accuracy for the rest");
its GLUE average is the mean of 9 numbers: MNLI-m, MNLI-mm, QNLI, QQP, SST-2, CoLA, MRPC, RTE, STS-B (no WNLI).
`glue_average` averages whichever of these are present.
"""
from __future__ import annotations

import csv
import io
import os
from typing import Mapping, Sequence

import numpy as np
from scipy import stats
from sklearn import metrics as skm

from tupe_jax import files

# The paper's average: (report column, task, metric key).
PAPER_COLUMNS = (("MNLI-m", "mnli", "accuracy"), ("MNLI-mm", "mnli", "accuracy_mm"), ("QNLI", "qnli", "accuracy"),
                 ("QQP", "qqp", "accuracy"), ("SST-2", "sst2", "accuracy"), ("CoLA", "cola", "matthews_corr"),
                 ("MRPC", "mrpc", "accuracy"), ("RTE", "rte", "accuracy"), ("STS-B", "stsb", "pearson"))
EXTRA_COLUMNS = (("WNLI", "wnli", "accuracy"), ("WordOrder", "wordorder", "accuracy"))

# Submission file names and label strings (class index order as in tupe_jax/data/glue_tsv.py).
SUBMISSION_FILES = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "stsb": "STS-B", "qqp": "QQP",
                    "mnli": "MNLI-m", "mnli_mm": "MNLI-mm", "qnli": "QNLI", "rte": "RTE", "wnli": "WNLI",
                    "ax": "AX", "wordorder": "WordOrder"}
LABEL_STRINGS = {"mnli": ("entailment", "neutral", "contradiction"), "ax": ("entailment", "neutral", "contradiction"),
                 "qnli": ("entailment", "not_entailment"), "rte": ("entailment", "not_entailment")}


def accuracy(labels: Sequence[int], preds: Sequence[int]) -> float:
    return float(skm.accuracy_score(labels, preds))


def f1(labels: Sequence[int], preds: Sequence[int]) -> float:
    """Binary F1 of the positive class (1 = paraphrase / duplicate)."""
    return float(skm.f1_score(labels, preds, pos_label=1, zero_division=0.0))


def matthews(labels: Sequence[int], preds: Sequence[int]) -> float:
    return float(skm.matthews_corrcoef(labels, preds))


def _constant(x: np.ndarray) -> bool:
    return len(x) < 2 or bool(np.all(x == x[0]))


def pearson(labels: Sequence[float], preds: Sequence[float]) -> float:
    """Pearson r; 0.0 when either side is constant (undefined, e.g. a collapsed regressor)."""
    a, b = np.asarray(labels, np.float64), np.asarray(preds, np.float64)
    return 0.0 if _constant(a) or _constant(b) else float(stats.pearsonr(a, b)[0])


def spearman(labels: Sequence[float], preds: Sequence[float]) -> float:
    a, b = np.asarray(labels, np.float64), np.asarray(preds, np.float64)
    return 0.0 if _constant(a) or _constant(b) else float(stats.spearmanr(a, b)[0])


def task_metrics(task: str, labels: np.ndarray, outputs: np.ndarray) -> dict[str, float]:
    """Dev metrics of `task` from labels and model outputs (logits (N, C), or (N,)/(N, 1) scores for STS-B)."""
    outputs = np.asarray(outputs)
    if task == "stsb":
        scores = outputs.reshape(-1)
        return {"pearson": pearson(labels, scores), "spearman": spearman(labels, scores)}
    preds = outputs.argmax(-1) if outputs.ndim == 2 else outputs
    labels = np.asarray(labels).astype(np.int64)
    if task == "cola":
        return {"matthews_corr": matthews(labels, preds), "accuracy": accuracy(labels, preds)}
    if task in ("mrpc", "qqp"):
        return {"accuracy": accuracy(labels, preds), "f1": f1(labels, preds)}
    return {"accuracy": accuracy(labels, preds)}


def headline_key(task: str) -> str:
    """The metric a task is ranked and reported by (model selection and the sweep)."""
    return {"cola": "matthews_corr", "stsb": "pearson"}.get(task, "accuracy")


def majority_accuracy(labels: Sequence[int]) -> float:
    """Accuracy of always predicting the most frequent label."""
    _, counts = np.unique(np.asarray(labels), return_counts=True)
    return float(counts.max() / counts.sum())


def glue_average(scores: Mapping[str, float]) -> tuple[float | None, list[str]]:
    """Mean of the paper's 9 columns present in `scores` ({column name: value}); (None, []) if none."""
    present = [name for name, _, _ in PAPER_COLUMNS if scores.get(name) is not None]
    if not present:
        return None, []
    return float(np.mean([scores[n] for n in present])), present


def report_columns(task: str) -> list[tuple[str, str]]:
    """[(column name, metric key)] a task contributes to the results table."""
    return [(name, key) for name, t, key in PAPER_COLUMNS + EXTRA_COLUMNS if t == task]


def format_prediction(task: str, output: np.ndarray) -> str:
    """One prediction as the GLUE server expects it (label string, 0/1 int, or STS-B float in [0, 5])."""
    output = np.asarray(output)
    if task == "stsb":
        return f"{float(np.clip(output.reshape(-1)[0], 0.0, 5.0)):.3f}"
    cls = int(output.argmax(-1)) if output.ndim else int(output)
    return LABEL_STRINGS[task][cls] if task in LABEL_STRINGS else str(cls)


def write_submission(directory: str, task: str, indices: Sequence[int], outputs: np.ndarray) -> str:
    """Write `<directory>/<Name>.tsv` with header `index\tprediction`, one row per test example; return the path.

    `task` may be a GLUE task, `mnli_mm` (MNLI-mm.tsv) or `ax` (AX.tsv, MNLI labels).
    """
    label_task = "mnli" if task == "mnli_mm" else task
    text = io.StringIO()
    writer = csv.writer(text, delimiter="\t", lineterminator="\n")
    writer.writerow(["index", "prediction"])
    for idx, out in zip(indices, outputs):
        writer.writerow([int(idx), format_prediction(label_task, out)])
    return files.write_text(os.path.join(directory, SUBMISSION_FILES[task] + ".tsv"), text.getvalue())


# ------------------------------------------------------------------------------------------------ sweep tables
def summarize_sweep(workdir: str, tasks: Sequence[str], lrs: Sequence[float], seeds: Sequence[int],
                    run_dir) -> dict:
    """Collect `results.json` of every (task, lr, seed) run and apply the paper's rule.

    Per task and report column: the median over seeds of each run's best-epoch dev value, per lr; the best lr is
    the one with the highest median of the task's headline column (MNLI: matched); every column of the task is
    reported at that lr. Values x100. `glue_average` is the mean of the paper's 9 columns that are present.
    """
    out: dict = {"protocol": "median over seeds of each run's best-epoch dev score; best lr by the headline median; "
                             "GLUE average over the TUPE paper's 9 columns present (x100)",
                 "tasks": {}, "reported": {}}
    for task in tasks:
        columns = report_columns(task)
        head = [name for name, key in columns if key == headline_key(task)][0]
        per_lr: dict[str, dict] = {}
        for lr in lrs:
            runs = {}
            for seed in seeds:
                path = files.join(run_dir(workdir, task, lr, seed), "results.json")
                if files.isfile(path):           # a bucket sweep's too
                    best = (files.read_json(path).get("best") or {}).get("metrics") or {}
                    runs[str(seed)] = {name: 100.0 * best[key] for name, key in columns if key in best}
            medians = {name: float(np.median([r[name] for r in runs.values() if name in r]))
                       for name, _ in columns if any(name in r for r in runs.values())}
            per_lr[f"{float(lr):g}"] = {"seeds": runs, "median": medians, "runs": len(runs)}
        done = {lr: v for lr, v in per_lr.items() if head in v["median"]}
        best_lr = max(done, key=lambda lr: done[lr]["median"][head]) if done else None
        reported = dict(done[best_lr]["median"]) if best_lr else {}
        out["tasks"][task] = {"columns": [n for n, _ in columns], "headline": head, "lrs": per_lr,
                              "best_lr": best_lr, "reported": reported}
        out["reported"].update(reported)
    avg, used = glue_average(out["reported"])
    out["glue_average"], out["glue_average_columns"] = avg, used
    return out


def sweep_markdown(summary: dict) -> str:
    """sweep.md: one table per task (median per lr, seeds finished) and the paper-style summary row."""
    lines = ["# GLUE sweep", "", summary["protocol"] + ".", ""]
    for task, info in summary["tasks"].items():
        cols = info["columns"]
        lines += [f"## {task} (best lr: {info['best_lr']})", "",
                  "| lr | runs | " + " | ".join(f"{c} (median)" for c in cols) + " |",
                  "|---|---|" + "---|" * len(cols)]
        for lr, v in info["lrs"].items():
            cells = [f"{v['median'][c]:.2f}" if c in v["median"] else "–" for c in cols]
            mark = " **best**" if lr == info["best_lr"] else ""
            lines.append(f"| {lr}{mark} | {v['runs']} | " + " | ".join(cells) + " |")
        lines.append("")
    names = [n for n, _, _ in PAPER_COLUMNS + EXTRA_COLUMNS if n in summary["reported"]]
    avg = summary["glue_average"]
    lines += ["## Reported (median at the best lr)", "", "| " + " | ".join(names) + " | Avg |",
              "|" + "---|" * (len(names) + 1),
              "| " + " | ".join(f"{summary['reported'][n]:.2f}" for n in names)
              + f" | {'–' if avg is None else f'{avg:.2f}'} |", "",
              f"Avg over: {', '.join(summary['glue_average_columns']) or 'none of the paper columns'}.", ""]
    return "\n".join(lines)
