"""REPORT.md and PNGs of a comparison suite, from the dict `analysis.suite.run` builds (also in report.json).

    write(report, workdir) -> [file names]   REPORT.md + loss_curves.png (+ glue.png); the analyses wrote their own
                                             extrapolation.png / probe.png into the same folder
    render(workdir) -> [file names]          the same from workdir/report.json (re-render without recomputing)

The "Checks" section states, with the numbers, whether each seed finding of the suite shows at this scale. It is
mechanical (fixed thresholds, written next to each check); judge it with the run size and the single seed in mind.
"""
from __future__ import annotations

import math
import os
from typing import Any, Optional

from tupe_jax import files, plots

GLUE_NAMES = {"cola": "CoLA (MCC)", "sst2": "SST-2 (acc)", "mrpc": "MRPC (acc)", "stsb": "STS-B (Pearson)",
              "qqp": "QQP (acc)", "mnli": "MNLI-m (acc)", "qnli": "QNLI (acc)", "rte": "RTE (acc)",
              "wnli": "WNLI (acc)", "wordorder": "word order (acc)"}


def _f(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return f"{x:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _smooth(values: list[float], k: int = 5) -> list[float]:
    out = []
    for i in range(len(values)):
        window = values[max(0, i - k + 1): i + 1]
        out.append(sum(window) / len(window))
    return out


def loss_curves(report: dict, path: str) -> str:
    """Train loss (moving average of 5 logged steps) and validation loss vs step, all schemes, per objective."""
    objectives = sorted({s["objective"] for s in report["schemes"]})
    fig, axes = plots.plt.subplots(len(objectives), 2, figsize=(10.4, 3.4 * len(objectives)), squeeze=False)
    for j, objective in enumerate(objectives):
        train_ax, eval_ax = axes[j]
        for s in (s for s in report["schemes"] if s["objective"] == objective):
            if s["train"]:
                train_ax.plot([r["step"] for r in s["train"]], _smooth([r["loss"] for r in s["train"]]),
                              label=s["label"])
            if s["eval"]:
                eval_ax.plot([r["step"] for r in s["eval"]], [r["eval_loss"] for r in s["eval"]], marker="o",
                             markersize=3, label=s["label"])
        kind = "MLM" if objective == "mlm" else "causal LM"
        train_ax.set_title(f"{kind}: train loss (moving avg)")
        eval_ax.set_title(f"{kind}: validation loss")
        for ax in (train_ax, eval_ax):
            ax.set_xlabel("step")
            ax.set_ylabel("loss (nats)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    return plots.save_figure(fig, path)


def glue_plot(report: dict, path: str) -> str:
    tasks = report["glue_tasks"]
    names = list(report["glue"])
    fig, ax = plots.plt.subplots(figsize=(max(6.0, 1.3 * len(tasks)), 3.6))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        scores = [100 * (report["glue"][name].get(t, {}).get("score") or 0.0) for t in tasks]
        ax.bar([k + i * width for k in range(len(tasks))], scores, width, label=name)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(tasks))], [GLUE_NAMES.get(t, t) for t in tasks],
                  fontsize=7)
    ax.set_ylabel("dev score x 100")
    ax.set_title("fine-tuning (best dev evaluation)")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    return plots.save_figure(fig, path)


# ------------------------------------------------------------------------------------------------ sections
def _setup(report: dict) -> list[str]:
    c = report["config"]
    m, t, d = c["model"], c["train"], c["data"]
    data = d["name"] + (f" ({d['path']})" if d.get("path") else "")
    lines = [f"# Comparison suite `{report['suite']}`", "",
             f"Schemes: {', '.join('`' + s['name'] + '`' for s in report['schemes'])}. Every scheme: "
             f"{m['num_layers']} layers, d={m['hidden_size']}, {m['num_heads']} heads, MLP {m['mlp_dim']}, vocab "
             f"{m['vocab_size']}, max_len {m['max_len']}, dropout {m['dropout_rate']}; {t['steps']} steps x batch "
             f"{t['batch_size']} x {m['max_len']} tokens, lr {t['learning_rate']:g} (warmup {t['warmup_steps']}, "
             f"linear decay), seed {t['seed']}, data `{data}`. Same data order, seed and steps for all schemes.", "",
             *([f"Command: `{report['command']}`", ""] if report.get("command") else []),
             "Wall time: " + ", ".join(f"{k[:-2]} {v / 60:.1f} min" for k, v in report["timings"].items()) + ".",
             "", "**One seed, small models, short training on CPU: differences of a few percent are within "
             "seed noise and prove nothing either way.**", ""]
    return lines


def _pretraining(report: dict) -> list[str]:
    rows = []
    for s in report["schemes"]:
        e = s["final_eval"]
        last = s["train"][-1]["loss"] if s["train"] else None
        extra = (f"ppl {_f(e.get('eval_perplexity'), 1)}" if s["objective"] == "clm"
                 else f"acc {_f(e.get('eval_mlm_accuracy'))}")
        minutes = _f((s.get("train_seconds") or 0) / 60, 1) + (" (reused)" if s.get("reused") else "")
        rows.append([f"`{s['name']}`", s["objective"], _f(last), _f(e.get("eval_loss")), extra, minutes,
                     _f(s.get("median_tokens_per_sec"), 0)])
    lines = ["## Pretraining", "", "Validation metrics at the last step (`train.eval_steps` batches of the "
             "validation split). Train min: the training steps' own time (no compile, eval or checkpointing); "
             "reused: trained by an earlier invocation with the same keys. ![loss curves](loss_curves.png)", ""]
    lines += _table(["run", "objective", "last train loss", "val loss", "val ppl / MLM acc", "train min",
                     "tokens/s"], rows)
    evals = {s["name"]: {r["step"]: r["eval_loss"] for r in s["eval"]} for s in report["schemes"]}
    steps = sorted({st for v in evals.values() for st in v})
    if len(steps) > 1:
        lines += ["", "Validation loss at equal steps:", ""]
        lines += _table(["step"] + [f"`{n}`" for n in evals],
                        [[str(st)] + [_f(evals[n].get(st)) for n in evals] for st in steps])
    return lines + [""]


def steps_to_reach(evals: list[dict], target: float) -> Optional[int]:
    """First eval step whose validation loss is <= target, or None."""
    for r in evals:
        if r["eval_loss"] <= target:
            return int(r["step"])
    return None


def _extrapolation(report: dict) -> list[str]:
    ex = report["extrapolation"]
    lengths = ex["lengths"]
    rows = []
    for r in ex["runs"]:
        cells = [_f(x["perplexity"], 1) if x["defined"] else "n/a" for x in r["results"]]
        rows.append([f"`{r['name']}`"] + cells)
    p = ex["protocol"]
    return (["## Extrapolation", "", f"Perplexity on the validation split ({p['mode']} windows"
             + (f", first {p['max_tokens']} tokens" if p.get("max_tokens") else "") + "), models trained at length "
             f"{report['config']['model']['max_len']}; n/a = a learned position table has no rows past max_len. "
             "![extrapolation](extrapolation.png)", ""]
            + _table(["run"] + [f"L={n}" for n in lengths], rows) + [""])


def _probe(report: dict) -> list[str]:
    pr = report["probe"]
    layers = max(len(r["layers"]) for r in pr["runs"])
    rows = []
    for r in pr["runs"]:
        mads = [x["mad"] for x in r["layers"]]
        best = min(range(len(mads)), key=mads.__getitem__)
        rows.append([f"`{r['name']}`"] + [_f(m, 1) for m in mads] + [""] * (layers - len(mads))
                    + [f"{_f(mads[best], 1)} (layer {best})", _f(r["chance_mad"], 1)])
    s = pr["settings"]
    return (["## Position probes", "", f"Mean absolute distance (MAD, positions) of a 2-layer ReLU probe predicting "
             f"each token's absolute position from frozen hidden states; layer 0 = embedding output; {s['steps']} "
             f"Adam steps on {s['train_tokens']} training tokens, {s['eval_tokens']} validation tokens. Lower = more "
             "position information; chance = (n²−1)/(3n). ![probe](probe.png)", ""]
            + _table(["run"] + [f"layer {i}" for i in range(layers)] + ["min", "chance"], rows) + [""])


def _glue(report: dict) -> list[str]:
    tasks, glue = report["glue_tasks"], report["glue"]
    rows, header = [], ["run"] + [GLUE_NAMES.get(t, t) for t in tasks] + ["GLUE avg"]
    for name, by_task in glue.items():
        scores = [by_task.get(t, {}).get("score") for t in tasks]
        real = [x for t, x in zip(tasks, scores) if t != "wordorder" and x is not None]
        rows.append([f"`{name}`"] + [_f(100 * x, 1) if x is not None else "—" for x in scores]
                    + [_f(100 * sum(real) / len(real), 1) if real else "—"])
    first = next(iter(glue.values()), {})
    base = [(first.get(t, {}).get("majority_baseline") or {}).get("accuracy") for t in tasks]
    rows.append(["majority class"] + [_f(100 * b, 1) if b is not None else "—" for b in base] + [""])
    steps = ", ".join(f"{t} {first[t]['steps']}" for t in tasks if t in first)
    g = report["config"]["glue"]
    return (["## Fine-tuning", "", f"Best dev score over epoch-end evaluations (one run per scheme and task, lr "
             f"{g['learning_rate']:g}, batch {g['batch_size']}, seed {g['seed']}, up to {g['epochs']} epochs, at most "
             f"{g['max_steps']} steps per task: a capped task sees only steps x batch training examples). Steps: "
             f"{steps}. GLUE avg excludes word order. ![glue](glue.png)", ""] + _table(header, rows) + [""])


def _checks(report: dict) -> list[str]:
    """Mechanical statements of each seed finding, with the numbers."""
    out: list[str] = []
    by = {s["name"]: s for s in report["schemes"]}

    def val(name: str, key: str = "eval_loss") -> Optional[float]:
        return by[name]["final_eval"].get(key) if name in by else None

    if "extrapolation" in report:
        runs = {r["name"]: r for r in report["extrapolation"]["runs"]}
        train_len = report["config"]["model"]["max_len"]
        for name, r in runs.items():
            at = {x["length"]: x.get("perplexity") for x in r["results"] if x["defined"]}
            if train_len in at and len(at) > 1:
                longest = max(at)
                ratio = at[longest] / at[train_len]
                verdict = "holds or improves" if ratio <= 1.05 else "degrades"
                out.append(f"- `{name}`: perplexity {at[train_len]:.1f} at L={train_len} → {at[longest]:.1f} at "
                           f"L={longest} (x{ratio:.2f}): {verdict} past the training length (threshold x1.05).")
            elif train_len in at:
                out.append(f"- `{name}`: {at[train_len]:.1f} at L={train_len}; not defined beyond it.")
    clm = {n: val(n, "eval_perplexity") for n in by if by[n]["objective"] == "clm"}
    if "nopos-clm" in clm and len(clm) > 1:
        others = {n: v for n, v in clm.items() if n != "nopos-clm" and v}
        best = min(others.values())
        gap = clm["nopos-clm"] / best - 1
        out.append(f"- causal NoPos validation perplexity {clm['nopos-clm']:.1f} vs "
                   + ", ".join(f"{n} {v:.1f}" for n, v in others.items())
                   + f": {100 * gap:+.1f}% vs the best; 'close' (within 10%): {'yes' if gap <= 0.10 else 'no'}.")
    if "nopos-mlm" in by:
        refs = {n: val(n) for n in by if by[n]["objective"] == "mlm" and n != "nopos-mlm" and val(n)}
        if refs and val("nopos-mlm"):
            ref = min(refs.values())
            out.append(f"- bidirectional NoPos MLM validation loss {val('nopos-mlm'):.3f} vs "
                       + ", ".join(f"{n} {v:.3f}" for n, v in refs.items())
                       + f" (x{math.exp(val('nopos-mlm') - ref):.2f} in perplexity): fails to match (> 0.2 nats "
                       f"worse): {'yes' if val('nopos-mlm') - ref > 0.2 else 'no'}.")
    if "probe" in report:
        for r in report["probe"]["runs"]:
            mads = [x["mad"] for x in r["layers"]]
            mid = len(mads) // 2
            out.append(f"- probe `{r['name']}`: MAD {mads[0]:.1f} at the embeddings, {mads[mid]:.1f} at layer {mid}, "
                       f"min {min(mads):.1f}; chance {r['chance_mad']:.1f}; 'far below chance' (< chance/2) at the "
                       f"middle layer: {'yes' if mads[mid] < r['chance_mad'] / 2 else 'no'}.")
    if report["suite"] == "tupe" and "bert_a-mlm" in by:
        base = val("bert_a-mlm")
        for n in by:
            if n == "bert_a-mlm" or not val(n):
                continue
            reach = steps_to_reach(by[n]["eval"], base) if base else None
            out.append(f"- `{n}` final validation MLM loss {val(n):.3f} vs bert_a {base:.3f} ({val(n) - base:+.3f}); "
                       f"reaches bert_a's final loss at step {reach if reach else 'never'} of "
                       f"{report['config']['train']['steps']}.")
    if "glue" in report:
        avgs = {}
        for name, by_task in report["glue"].items():
            real = [v["score"] for t, v in by_task.items() if t != "wordorder" and v.get("score") is not None]
            if real:
                avgs[name] = 100 * sum(real) / len(real)
        if avgs:
            order = sorted(avgs, key=avgs.get, reverse=True)
            out.append("- GLUE average ranking: " + " > ".join(f"`{n}` {avgs[n]:.1f}" for n in order) + ".")
            if "tupe_a-mlm" in avgs and "tupe_a-mlm-tiedcls" in avgs:
                d = avgs["tupe_a-mlm"] - avgs["tupe_a-mlm-tiedcls"]
                out.append(f"- untied [CLS]: tupe_a {avgs['tupe_a-mlm']:.1f} vs tied {avgs['tupe_a-mlm-tiedcls']:.1f} "
                           f"({d:+.1f}).")
    return (["## Checks", "", "Mechanical, one seed; thresholds as stated."] + [""] + out + [""]) if out else []


def write(report: dict, workdir: str) -> list[str]:
    """Write REPORT.md (+ loss_curves.png, glue.png) into `workdir`; return the names written."""
    names = ["report.json", os.path.basename(loss_curves(report, os.path.join(workdir, "loss_curves.png")))]
    lines = _setup(report) + _pretraining(report)
    if "extrapolation" in report:
        lines += _extrapolation(report)
        names.append("extrapolation.png")
    if "probe" in report:
        lines += _probe(report)
        names.append("probe.png")
    if report.get("glue"):
        lines += _glue(report)
        names.append(os.path.basename(glue_plot(report, os.path.join(workdir, "glue.png"))))
    lines += _checks(report)
    files.write_text(os.path.join(workdir, "REPORT.md"), "\n".join(lines))
    return ["REPORT.md"] + names


def render(workdir: str) -> list[str]:
    """Re-render REPORT.md and the PNGs from workdir/report.json."""
    return write(files.read_json(os.path.join(workdir, "report.json")), workdir)
