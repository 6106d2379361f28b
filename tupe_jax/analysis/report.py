"""REPORT.md and PNGs of a comparison suite, from the dict `analysis.suite.run` builds (also in report.json).

    write(report, workdir) -> [file names]   REPORT.md + loss_curves.png (+ extrapolation.png, probe.png, glue.png);
                                             each plot shows every seed; the per-seed analyses' own JSON and PNGs
                                             are in workdir/seed<k>/
    render(workdir) -> [file names]          the same from workdir/report.json (re-render without recomputing)

Tables give mean ± sample std over seeds. The "Findings" section applies the verdict rule of `analysis.findings`.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Optional

from tupe_jax import files, plots
from tupe_jax.errors import require
from tupe_jax.analysis import findings
from tupe_jax.analysis.findings import glue_average, mean_spread, mean_std

GLUE_NAMES = {"cola": "CoLA (MCC)", "sst2": "SST-2 (acc)", "mrpc": "MRPC (acc)", "stsb": "STS-B (Pearson)",
              "qqp": "QQP (acc)", "mnli": "MNLI-m (acc)", "qnli": "QNLI (acc)", "rte": "RTE (acc)",
              "wnli": "WNLI (acc)", "wordorder": "word order (acc)"}
COLORS = plots.plt.rcParams["axes.prop_cycle"].by_key()["color"]


def _f(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return f"{x:.{digits}f}"


def _ms(values: list[Optional[float]], digits: int = 3, scale: float = 1.0) -> str:
    """'mean ± std' over the values that exist ('—' if none; just the value for one), and "(k of n)" when some of
    the n do not (a missing or non-finite value: a diverged or unfinished run)."""
    vals = [scale * v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return "—"
    m, s = mean_std(vals)
    return (_f(m, digits) + (f" ± {_f(s, digits)}" if len(vals) > 1 else "")
            + (f" ({len(vals)} of {len(values)})" if len(vals) < len(values) else ""))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _runs(scheme: dict) -> list[dict]:
    return [scheme["seeds"][k] for k in sorted(scheme["seeds"], key=int)]


def _eval_value(run: dict, key: str) -> Optional[float]:
    return run["final_eval"].get(key)


# ------------------------------------------------------------------------------------------------ plots
def loss_curves(report: dict, path: str) -> str:
    """Validation loss vs step per objective; one thin line per seed, the mean over seeds thick."""
    objectives = sorted({s["objective"] for s in report["schemes"]})
    fig, axes = plots.plt.subplots(1, len(objectives), figsize=(6.2 * len(objectives), 3.8), squeeze=False)
    for ax, objective in zip(axes[0], objectives):
        for i, s in enumerate(x for x in report["schemes"] if x["objective"] == objective):
            color, by_step = COLORS[i % len(COLORS)], {}
            for run in _runs(s):
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


def _per_scheme_plot(report: dict, path: str, series: dict[str, list[tuple[list, list]]], xlabel: str, ylabel: str,
                     title: str, log_y: bool = False, hline: Optional[float] = None) -> str:
    """One thin line per seed and scheme (same colour per scheme)."""
    fig, ax = plots.plt.subplots(figsize=(6.8, 4.0))
    for i, (name, lines) in enumerate(series.items()):
        for j, (xs, ys) in enumerate(lines):
            ax.plot(xs, ys, marker="o", markersize=3, color=COLORS[i % len(COLORS)], alpha=0.7,
                    label=name if j == 0 else None)
    if hline is not None:
        ax.axhline(hline, color="gray", linestyle="--", label="chance")
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return plots.save_figure(fig, path)


def _by_scheme(report: dict, key: str) -> dict[str, list[dict]]:
    """{scheme name: [the analysis' run dict for each seed]} for key 'extrapolation' or 'probe'."""
    where = {r["path"]: s["name"] for s in report["schemes"] for r in s["seeds"].values()}
    out: dict[str, list[dict]] = {}
    for seed in sorted(report.get(key, {}), key=int):
        for run in report[key][seed]["runs"]:
            out.setdefault(where.get(run["workdir"], run["name"]), []).append(run)
    return out


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


# ------------------------------------------------------------------------------------------------ sections
def _tokens(n: int) -> str:
    """3.1M; below 100k the count itself (a tiny run's 0.0M said nothing)."""
    return f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n:,}"


def _setup(report: dict) -> list[str]:
    c = report["config"]
    m, t, d = c["model"], c["train"], c["data"]
    data = d["name"] + (f" ({d['path']})" if d.get("path") else "")
    seeds = ", ".join(map(str, report["seeds"]))
    return [f"# Comparison suite `{report['suite']}`", "",
            f"Schemes: {', '.join('`' + s['name'] + '`' for s in report['schemes'])}. Every run: "
            f"{m['num_layers']} layers, d={m['hidden_size']}, {m['num_heads']} heads, MLP {m['mlp_dim']}, vocab "
            f"{m['vocab_size']}, max_len {m['max_len']}, dropout {m['dropout_rate']}; {t['steps']} steps x batch "
            f"{t['batch_size']} x {m['max_len']} tokens ({_tokens(t['steps'] * t['batch_size'] * m['max_len'])} "
            f"tokens), lr {t['learning_rate']:g} (warmup {t['warmup_steps']}, linear decay), data `{data}`. "
            f"Seeds {seeds}: a seed fixes initialisation, dropout, data order and masking, so every scheme of one "
            "seed saw the same batches (differences are paired by seed).", "",
            *([f"Command: `{report['command']}`" + _older_defaults(m), ""] if report.get("command") else []),
            "Wall time: " + ", ".join(f"{k[:-2]} {v / 60:.1f} min" for k, v in report["timings"].items())
            + _reused(report) + ".", ""]


def _older_defaults(model: dict) -> str:
    """What the command needs today to train what it trained then (a report made before a key existed)."""
    if "dropout_bits" in model:
        return ""
    return (" (made before `model.dropout_bits` existed, with 32-bit dropout masks: today's default is 16, so add "
            "`--config.model.dropout_bits=32` to train the same runs)")


def _reused(report: dict) -> str:
    """How many pretraining runs this command reused (their training time is not in its wall time)."""
    runs = [r for s in report["schemes"] for r in s.get("seeds", {}).values()]
    reused = sum(bool(r.get("reused")) for r in runs)
    return (f" ({reused} of {len(runs)} pretraining runs reused from an earlier command: their training time is "
            "in their own metrics.jsonl)") if reused else ""


def _pretraining(report: dict) -> list[str]:
    rows = []
    for s in report["schemes"]:
        runs = _runs(s)
        extra = (f"ppl {_ms([_eval_value(r, 'eval_perplexity') for r in runs], 1)}" if s["objective"] == "clm"
                 else f"acc {_ms([_eval_value(r, 'eval_mlm_accuracy') for r in runs])}")
        minutes = _ms([(r.get("train_seconds") or 0) / 60 for r in runs], 1)
        tps = [r["median_tokens_per_sec"] for r in runs if r.get("median_tokens_per_sec")]
        rows.append([f"`{s['name']}`", str(len(runs)), _ms([_eval_value(r, "eval_loss") for r in runs]), extra,
                     minutes, _f(sorted(tps)[len(tps) // 2] if tps else None, 0)])
    lines = ["## Pretraining", "", "Validation metrics at the last step, mean ± std over seeds. Train min: the "
             "training steps' own time (no compile, eval or checkpointing); tokens/s: median over seeds of each "
             "run's median. ![loss curves](loss_curves.png)", ""]
    lines += _table(["run", "seeds", "val loss", "val ppl / MLM acc", "train min", "tokens/s"], rows)
    curves = {s["name"]: {} for s in report["schemes"]}
    for s in report["schemes"]:
        for run in _runs(s):
            for r in run["eval"]:
                curves[s["name"]].setdefault(r["step"], []).append(r["eval_loss"])
    steps = sorted({k for v in curves.values() for k in v})
    if len(steps) > 1:
        lines += ["", "Validation loss at equal steps (mean ± std over seeds):", ""]
        lines += _table(["step"] + [f"`{n}`" for n in curves],
                        [[str(k)] + [_ms(curves[n].get(k, [])) for n in curves] for k in steps])
    return lines + [""]


def _extrapolation(report: dict, workdir: str) -> list[str]:
    by = _by_scheme(report, "extrapolation")
    first = report["extrapolation"][str(report["seeds"][0])]
    lengths, p = first["lengths"], first["protocol"]
    rows, series = [], {}
    for name, runs in by.items():
        cells = []
        for k, length in enumerate(lengths):
            vals = [r["results"][k]["perplexity"] for r in runs if r["results"][k]["defined"]]
            cells.append(_ms(vals, 1) if vals else "n/a")
        rows.append([f"`{name}`"] + cells)
        series[name] = [([x["length"] for x in r["results"] if x["defined"]],
                         [x["perplexity"] for x in r["results"] if x["defined"]]) for r in runs]
    _per_scheme_plot(report, os.path.join(workdir, "extrapolation.png"), series, "evaluation length",
                     "validation perplexity", "extrapolation, every seed", log_y=True)
    return (["## Extrapolation", "", f"Perplexity on the validation split ({p['mode']} windows"
             + (f", first {p['max_tokens']} tokens" if p.get("max_tokens") else "") + "), models trained at length "
             f"{report['config']['model']['max_len']}, mean ± std over seeds; n/a = a learned position table has "
             "no rows past max_len. ![extrapolation](extrapolation.png)", ""]
            + _table(["run"] + [f"L={n}" for n in lengths], rows) + [""])


def _probe(report: dict, workdir: str) -> list[str]:
    by = _by_scheme(report, "probe")
    layers = max(len(r["layers"]) for runs in by.values() for r in runs)
    rows, series, chance = [], {}, None
    for name, runs in by.items():
        chance = runs[0]["chance_mad"]
        rows.append([f"`{name}`"] + [_ms([r["layers"][i]["mad"] for r in runs if i < len(r["layers"])], 1)
                                     for i in range(layers)] + [_f(chance, 1)])
        series[name] = [(list(range(len(r["layers"]))), [x["mad"] for x in r["layers"]]) for r in runs]
    _per_scheme_plot(report, os.path.join(workdir, "probe.png"), series, "layer (0 = embeddings)",
                     "probe MAD (positions)", "absolute-position probes, every seed", hline=chance)
    s = report["config"]["probe"]
    return (["## Position probes", "", "Mean absolute distance (MAD, positions) of a 2-layer ReLU probe predicting "
             f"each token's absolute position from frozen hidden states, mean ± std over seeds; layer 0 = embedding "
             f"output; {s['steps']} Adam steps on {s['train_tokens']} training tokens, {s['eval_tokens']} validation "
             "tokens. Lower = more position information; chance = (n²−1)/(3n). ![probe](probe.png)", ""]
            + _table(["run"] + [f"layer {i}" for i in range(layers)] + ["chance"], rows) + [""])


def _majority_cell(task: str, run: dict) -> str:
    """The train set's majority label predicted everywhere, in the column's metric: its dev accuracy, but 0 for
    CoLA (the MCC of any constant prediction) and none for STS-B (regression)."""
    accuracy = (run.get("majority_baseline") or {}).get("accuracy")
    if accuracy is None:
        return "—"
    return "0.0" if task == "cola" else _f(100 * accuracy, 1)


def _glue(report: dict) -> list[str]:
    tasks, glue = report["glue_tasks"], report["glue"]
    rows, header = [], ["run"] + [GLUE_NAMES.get(t, t) for t in tasks] + ["GLUE avg"]
    for name, by_seed in glue.items():
        cells = [_ms([r.get(t, {}).get("score") for r in by_seed.values()], 1, 100) for t in tasks]
        avgs = [glue_average(r, tasks) for r in by_seed.values()]
        rows.append([f"`{name}`"] + cells + [_ms(avgs, 1)])
    first = next(iter(next(iter(glue.values())).values()))
    rows.append(["majority class"] + [_majority_cell(t, first.get(t, {})) for t in tasks] + [""])
    steps = ", ".join(f"{t} {first[t]['steps']}" for t in tasks if t in first)
    g = report["config"]["glue"]
    return (["## Fine-tuning", "", f"Best dev score over epoch-end evaluations, mean ± std over seeds (one run per "
             f"scheme, seed and task; the fine-tuning seed is the pretraining seed; lr {g['learning_rate']:g}, batch "
             f"{g['batch_size']}, up to {g['epochs']} epochs, at most {g['max_steps']} steps per task: a capped task "
             f"sees only steps x batch training examples). Steps: {steps}. GLUE avg excludes word order. "
             "![glue](glue.png)", ""] + _table(header, rows) + [""])


def _findings(report: dict) -> list[str]:
    if not report.get("findings"):
        return []
    rows = []
    for f in report["findings"]:
        for i, p in enumerate(f["parts"]):
            per_seed = ", ".join(f"{_f(v, 4)}" for _, v in sorted(p["per_seed"].items(), key=lambda kv: int(kv[0])))
            rows.append([f"{f['claim']} ({f['paper']})" if i == 0 else "", p["comparison"], per_seed,
                         f"{mean_spread(p)} {p['unit']}", p['verdict'],
                         f"**{f['verdict']}**" if i == 0 else ""])
    notes = [f"- {f['claim']}: {f['note']}" for f in report["findings"] if f.get("note")]
    return (["## Findings", "", "Each comparison is a per-seed paired difference predicted positive by the paper. "
             "Rule (analysis/findings.py): *reproduced* when every seed's difference is positive and the mean "
             "exceeds the standard deviation over seeds, *contradicted* when the same holds the other way, *no "
             "evidence at this scale* otherwise; at least 3 seeds. A claim made of several comparisons is reproduced "
             "only if each is.", ""]
            + _table(["finding", "comparison", "per seed", "mean ± std", "verdict", "claim"], rows)
            + ([""] + notes if notes else []) + [""])


def write(report: dict, workdir: str) -> list[str]:
    """Write REPORT.md and the PNGs into `workdir`; return the names written."""
    names = ["report.json", os.path.basename(loss_curves(report, os.path.join(workdir, "loss_curves.png")))]
    lines = _setup(report) + _findings(report) + _pretraining(report)
    if report.get("extrapolation"):
        lines += _extrapolation(report, workdir)
        names.append("extrapolation.png")
    if report.get("probe"):
        lines += _probe(report, workdir)
        names.append("probe.png")
    if report.get("glue"):
        lines += _glue(report)
        names.append(os.path.basename(glue_plot(report, os.path.join(workdir, "glue.png"))))
    files.write_text(os.path.join(workdir, "REPORT.md"), "\n".join(lines))
    return ["REPORT.md"] + names


def render(workdir: str) -> list[str]:
    """Re-render REPORT.md and the PNGs from workdir/report.json, with the findings recomputed from its data
    (report.json is rewritten when they changed)."""
    path = os.path.join(workdir, "report.json")
    require(os.path.isfile(path), f"{path} does not exist", "--workdir", "point it at a `launch compare` folder")
    try:
        report = files.read_json(path)
    except ValueError:
        report = None
    require(isinstance(report, dict) and {"schemes", "seeds", "config"} <= set(report),
            f"{path} is not a compare report", "--workdir", "point it at a `launch compare` folder, or restore its "
            "report.json")
    fresh = json.loads(files.to_json(findings.evaluate(report)))       # as stored (NaN as null)
    if fresh != report.get("findings"):
        report["findings"] = fresh
        files.write_json(path, report, indent=1)
    return write(report, workdir)
