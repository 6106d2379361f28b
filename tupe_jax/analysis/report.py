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
import shutil
import tempfile
from typing import Any, Optional

from tupe_jax import files
from tupe_jax.errors import UserError, require
from tupe_jax.analysis import findings
from tupe_jax.analysis.findings import glue_average, mean_spread, mean_std
from tupe_jax.analysis.report_plots import GLUE_NAMES, glue_plot, loss_curves, per_scheme_plot, runs_by_seed

def _f(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return f"{x:.{digits}f}"


def _ms(values: list[Optional[float]], digits: int = 3, scale: float = 1.0) -> str:
    """'mean ± std' over the values that exist ('—' if none; just the value for one), and "(k of n)" when some of
    the n do not (a missing or non-finite value: a diverged or unfinished run)."""
    vals = [scale * v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return "—" + (f" (0 of {len(values)})" if values else "")
    m, s = mean_std(vals)
    return (_f(m, digits) + (f" ± {_f(s, digits)}" if len(vals) > 1 else "")
            + (f" ({len(vals)} of {len(values)})" if len(vals) < len(values) else ""))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _eval_value(run: dict, key: str) -> Optional[float]:
    return run["final_eval"].get(key)


def _gone(report: dict, name: str) -> list[None]:
    """A None per diverged seed of scheme `name` (not analysed): the tables count them ("2 of 3")."""
    return [None for s in report["schemes"] if s["name"] == name for r in s["seeds"].values() if r.get("diverged")]


def _by_scheme(report: dict, key: str) -> dict[str, list[dict]]:
    """{scheme name: [the analysis' run dict for each seed]} for key 'extrapolation' or 'probe'; a scheme the
    analysis covers whose every seed diverged maps to [] (its row counts them: "— (0 of 2)")."""
    where = {r["path"]: s["name"] for s in report["schemes"] for r in s["seeds"].values()}
    out: dict[str, list[dict]] = {}
    for seed in sorted(report.get(key, {}), key=int):
        for run in report[key][seed]["runs"]:
            out.setdefault(where.get(run["workdir"], run["name"]), []).append(run)
    for s in report["schemes"]:
        covered = key == "probe" or s.get("objective") == "clm"     # extrapolation: the causal runs
        if covered and s["name"] not in out and s["seeds"] and all(r.get("diverged") for r in s["seeds"].values()):
            out[s["name"]] = []
    return out


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
            *([f"Command: `{report['command']}`" + _older_defaults(report), ""] if report.get("command") else []),
            "Wall time: " + ", ".join(f"{k[:-2]} {v / 60:.1f} min" for k, v in report["timings"].items())
            + _reused(report) + ".", ""]


# Model keys whose default in configs/ changed after committed suites ran: (key, today's default, the value of a
# report made before the key existed, the objectives it acts on, what the older value means).
CHANGED_DEFAULTS = (
    ("dropout_bits", 16, 32, ("mlm", "clm"), "32-bit dropout masks (other masks than today's 16)"),
    ("last_layer_rows", "predicted", "all", ("mlm",),
     "the last block at every position (today's `predicted`: the same maths at the masked ones, other rounding)"),
)


def _older_defaults(report: dict) -> str:
    """What the command needs today to train what it trained then: each key whose value in the suite (or, before
    the key existed, the code's behaviour then) differs from today's default and that the command does not set."""
    model, command = report["config"]["model"], report["command"]
    objectives = {s.get("objective") for s in report["schemes"]}
    older = [(key, model.get(key, then), meaning) for key, now, then, acts_on, meaning in CHANGED_DEFAULTS
             if objectives & set(acts_on) and model.get(key, then) != now and f"--config.model.{key}=" not in command]
    if not older:
        return ""
    return (" (made with " + "; ".join(meaning for _, _, meaning in older) + ": add `"
            + " ".join(f"--config.model.{key}={value}" for key, value, _ in older) + "` to train the same runs)")


def _reused(report: dict) -> str:
    """How many pretraining runs this command reused (their training time is not in its wall time)."""
    runs = [r for s in report["schemes"] for r in s.get("seeds", {}).values()]
    reused = sum(bool(r.get("reused")) for r in runs)
    return (f" ({reused} of {len(runs)} pretraining runs reused from an earlier command: their training time is "
            "in their own metrics.jsonl)") if reused else ""


def _pretraining(report: dict) -> list[str]:
    rows = []
    for s in report["schemes"]:
        runs = runs_by_seed(s)
        extra = (f"ppl {_ms([_eval_value(r, 'eval_perplexity') for r in runs], 1)}" if s["objective"] == "clm"
                 else f"acc {_ms([_eval_value(r, 'eval_mlm_accuracy') for r in runs])}")
        minutes = _ms([(r.get("train_seconds") or 0) / 60 for r in runs], 1)
        tps = [r["median_tokens_per_sec"] for r in runs if r.get("median_tokens_per_sec")]
        rows.append([f"`{s['name']}`", str(len(runs)), _ms([_eval_value(r, "eval_loss") for r in runs]), extra,
                     minutes, _f(sorted(tps)[len(tps) // 2] if tps else None, 0)])
    lines = ["## Pretraining", "", "Validation metrics at the last step, mean ± std over seeds. Train min: the "
             "logged step times summed (the first logged window holds the compile; in runs made before 2026-12-06 "
             "the window after each evaluation held the evaluation too); tokens/s: median over seeds of each "
             "run's median. ![loss curves](loss_curves.png)", ""]
    gone = [f"`{s['name']}` seed {seed}: {r['diverged']}" for s in report["schemes"] for seed, r in
            sorted(s["seeds"].items(), key=lambda kv: int(kv[0])) if r.get("diverged")]
    if gone:
        lines += ["Diverged, so without final values and left out of every analysis and fine-tune (the comparisons "
                  "with them get no verdict): " + "; ".join(gone) + ".", ""]
    lines += _table(["run", "seeds", "val loss", "val ppl / MLM acc", "train min", "tokens/s"], rows)
    curves = {s["name"]: {} for s in report["schemes"]}
    for s in report["schemes"]:
        for run in runs_by_seed(s):
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
    first = next(iter(report["extrapolation"].values()))
    lengths, p = first["lengths"], first["protocol"]
    rows, series = [], {}
    for name, runs in by.items():
        cells = []
        for k, length in enumerate(lengths):
            vals = [r["results"][k]["perplexity"] for r in runs if r["results"][k]["defined"]]
            cells.append(_ms(vals + _gone(report, name), 1) if vals or not runs else "n/a")
        rows.append([f"`{name}`"] + cells)
        series[name] = [([x["length"] for x in r["results"] if x["defined"]],
                         [x["perplexity"] for x in r["results"] if x["defined"]]) for r in runs]
    per_scheme_plot(report, os.path.join(workdir, "extrapolation.png"), series, "evaluation length",
                     "validation perplexity", "extrapolation, every seed", log_y=True)
    return (["## Extrapolation", "", f"Perplexity on the validation split ({p['mode']} windows"
             + (f" every {p['stride']} tokens (capped at L)" if p.get("stride") else "")
             + (f", first {p['max_tokens']} tokens" if p.get("max_tokens") else "") + "), models trained at length "
             f"{report['config']['model']['max_len']}, mean ± std over seeds; n/a = a learned position table has "
             "no rows past max_len. ![extrapolation](extrapolation.png)", ""]
            + _table(["run"] + [f"L={n}" for n in lengths], rows) + [""])


def _probe(report: dict, workdir: str) -> list[str]:
    by = _by_scheme(report, "probe")
    layers = max((len(r["layers"]) for runs in by.values() for r in runs), default=0)
    chance = next((runs[0]["chance_mad"] for runs in by.values() if runs), None)
    first = {name: runs[0] for name, runs in by.items() if runs}
    median = any("median_mad" in r for r in first.values())    # written by probes made since it existed
    rows, series = [], {}
    for name, runs in by.items():
        run0 = first.get(name, {})       # a scheme's baselines are its first run's (every seed probes alike)
        rows.append([f"`{name}`"] + [_ms([r["layers"][i]["mad"] for r in runs if i < len(r["layers"])]
                                         + _gone(report, name), 1) for i in range(layers)]
                    + [_f(run0.get("chance_mad", chance), 1)] + ([_f(run0.get("median_mad"), 1)] if median else []))
        series[name] = [(list(range(len(r["layers"]))), [x["mad"] for x in r["layers"]]) for r in runs]
    per_scheme_plot(report, os.path.join(workdir, "probe.png"), series, "layer (0 = embeddings)",
                     "probe MAD (positions)", "absolute-position probes, every seed", hline=chance,
                     hline2=next((r["median_mad"] for r in first.values() if "median_mad" in r), None))
    s = report["config"]["probe"]
    return (["## Position probes", "", "Mean absolute distance (MAD, positions) of a 2-layer ReLU probe predicting "
             f"each token's absolute position from frozen hidden states, mean ± std over seeds; layer 0 = embedding "
             f"output; {s['steps']} Adam steps on {s['train_tokens']} training tokens, {s['eval_tokens']} validation "
             "tokens. Lower = more position information; chance = (n²−1)/(3n)"
             + (" over the n positions probed (MLM: 1..max_len−1, [CLS] at 0 left out); median = predicting the "
                "median position everywhere (≈n/4): a MAD between median and chance shows no position information"
                if median else "") + ". ![probe](probe.png)", ""]
            + _table(["run"] + [f"layer {i}" for i in range(layers)] + ["chance"] + (["median"] if median else []),
                     rows) + [""])


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
    first = next((r for by_seed in glue.values() for r in by_seed.values() if r), {})   # a diverged run has none
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
    """Write REPORT.md and the PNGs into `workdir`; return the names written (and report.json, the caller's). All
    are made in a hidden folder there first and moved in together: a report that fails half-way replaces nothing."""
    stage = tempfile.mkdtemp(prefix=".report.", suffix=".tmp", dir=workdir)
    try:
        names = _write_into(report, stage)
        for name in names:
            target = os.path.join(workdir, name)
            require(not os.path.isdir(target) or os.path.islink(target), f"{target} is a folder", "--workdir",
                    "move it aside: the report writes a file of that name there")
        for name in names:
            os.replace(os.path.join(stage, name), os.path.join(workdir, name))
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return [names[0], "report.json"] + names[1:]


def _write_into(report: dict, folder: str) -> list[str]:
    names = [os.path.basename(loss_curves(report, os.path.join(folder, "loss_curves.png")))]
    lines = _setup(report) + _findings(report) + _pretraining(report)
    if report.get("extrapolation"):
        lines += _extrapolation(report, folder)
        names.append("extrapolation.png")
    if report.get("probe"):
        lines += _probe(report, folder)
        names.append("probe.png")
    if report.get("glue"):
        lines += _glue(report)
        names.append(os.path.basename(glue_plot(report, os.path.join(folder, "glue.png"))))
    files.write_text(os.path.join(folder, "REPORT.md"), "\n".join(lines))
    return ["REPORT.md"] + names


def render(workdir: str) -> list[str]:
    """Re-render REPORT.md and the PNGs from workdir/report.json, with the findings recomputed from its data
    (report.json is rewritten when they changed, after the rest was written). A report.json that does not hold
    what a compare report holds (edited by hand, say) is refused, and nothing in the folder changes."""
    path = os.path.join(workdir, "report.json")
    require(os.path.isfile(path), f"{path} does not exist", "--workdir", "point it at a `launch compare` folder")
    try:
        report = files.read_json(path)
    except ValueError:
        report = None
    require(isinstance(report, dict) and {"schemes", "seeds", "config"} <= set(report),
            f"{path} is not a compare report", "--workdir", "point it at a `launch compare` folder, or restore its "
            "report.json")
    _require_shape(report, path)
    try:
        fresh = json.loads(files.to_json(findings.evaluate(report)))       # as stored (NaN as null)
        changed = fresh != report.get("findings")
        report["findings"] = fresh
        written = write(report, workdir)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError) as err:
        if isinstance(err, UserError):
            raise
        raise UserError(f"{path} does not hold what a compare report holds ({type(err).__name__}: "
                        f"{str(err)[:80]})", "--workdir", "restore its report.json, or rerun the compare command "
                        "that made it") from None
    if changed:
        files.write_json(path, report, indent=1)
    return written


def _require_shape(report: dict, path: str) -> None:
    """The top of a compare report: seeds a list of ints, schemes a non-empty list of objects with a name and
    per-seed runs, config an object."""
    seeds, schemes = report["seeds"], report["schemes"]
    ok = (isinstance(seeds, list) and seeds and all(isinstance(k, int) and not isinstance(k, bool) for k in seeds)
          and isinstance(schemes, list) and schemes and isinstance(report["config"], dict)
          and all(isinstance(s, dict) and isinstance(s.get("name"), str) and isinstance(s.get("seeds"), dict)
                  for s in schemes))
    require(bool(ok), f"{path} does not hold what a compare report holds (seeds: a list of ints; schemes: a list of "
            "objects with a name and seeds; config: an object)", "--workdir", "restore its report.json, or rerun "
            "the compare command that made it")
