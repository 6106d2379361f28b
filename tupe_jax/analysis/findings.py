"""Seed statistics and the verdict rule for the papers' findings, computed from a comparison suite's report dict.

Every finding is a predicted inequality `x > 0` on a per-seed quantity x_s, where x_s is a PAIRED difference: two
schemes trained with the same seed (same initialisation stream, data order and masking), or one scheme against a
fixed threshold. With n seeds, m = mean(x_s) and s = std(x_s) (sample, n − 1):

    reproduced     n ≥ 3, every x_s > 0 and m > s        (the difference exceeds the seed spread, in the paper's way)
    contradicted   n ≥ 3, every x_s < 0 and −m > s       (the same, the other way)
    no evidence    otherwise (at this scale; with n < 3 seeds: no verdict at all)

A seed whose x_s is missing or not finite (a run diverged, a score was not written) is no data: the comparison gets
no verdict rather than a mean over the other seeds or a "best of" over the other schemes.

A claim made of several pairwise comparisons (e.g. "ALiBi extrapolates best" = ALiBi flatter than each other
scheme) is reproduced when every part is, contradicted when any part is, no evidence otherwise.

    mean_std(values) -> (mean, std)        mean_spread(part) -> "mean ± std" as reports print it
    verdict(xs) -> str
    evaluate(report) -> [finding dict]   what the suite in `report` can say (empty list when nothing applies)
"""
from __future__ import annotations

import math
from typing import Optional

REPRODUCED, CONTRADICTED, NO_EVIDENCE, TOO_FEW = ("reproduced", "contradicted", "no evidence at this scale",
                                                  "no verdict (fewer than 3 seeds)")
UNDEFINED = "no verdict (a seed's value is missing or not finite: a diverged or unfinished run)"
UNSCORED = "no verdict (eval.lengths lacks the training length or a length above it: no growth was scored)"
MIN_SEEDS = 3
# NoPos Table 2's smallest model: NoPos 22.15 vs the best positional model (ALiBi) 19.94 perplexity, x1.11.
CLOSE_PPL_RATIO = 22.15 / 19.94
NOPOS_TABLE1 = ("bert_a-clm", "sinusoidal-clm", "alibi-clm")   # the positional models of NoPos Table 1
PROBE_FRACTION = 0.5          # "far below chance": probe MAD under half the chance MAD


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (NaN for one value: one seed shows no spread)."""
    n = len(values)
    m = sum(values) / n
    return m, (math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1)) if n > 1 else float("nan"))


def mean_spread(part: dict) -> str:
    """A part's 'mean ± std' to 4 places: the mean alone for one seed (which shows no spread), '—' if undefined."""
    def show(x: Optional[float]) -> str:
        return f"{x:.4f}" if _finite(x) else "—"
    return show(part["mean"]) + (f" ± {show(part['std'])}" if len(part["per_seed"]) > 1 else "")


def _finite(x: Optional[float]) -> bool:
    return x is not None and math.isfinite(x)


def verdict(xs: list[float]) -> str:
    """The rule in the module docstring for per-seed paired differences `xs` predicted positive."""
    if not all(_finite(x) for x in xs):
        return UNDEFINED
    if len(xs) < MIN_SEEDS:
        return TOO_FEW
    m, s = mean_std(xs)
    if all(x > 0 for x in xs) and m > s:
        return REPRODUCED
    if all(x < 0 for x in xs) and -m > s:
        return CONTRADICTED
    return NO_EVIDENCE


def combine(verdicts: list[str]) -> str:
    if UNDEFINED in verdicts:
        return UNDEFINED
    if not verdicts or TOO_FEW in verdicts:
        return TOO_FEW
    if CONTRADICTED in verdicts:
        return CONTRADICTED
    return REPRODUCED if all(v == REPRODUCED for v in verdicts) else NO_EVIDENCE


def _part(label: str, xs: dict[str, float], unit: str) -> dict:
    values = list(xs.values())
    m, s = mean_std(values) if values and all(_finite(v) for v in values) else (float("nan"), float("nan"))
    return {"comparison": label, "per_seed": xs, "mean": m, "std": s, "unit": unit, "verdict": verdict(values)}


def _finding(claim: str, paper: str, parts: list[dict], note: str = "") -> dict:
    return {"claim": claim, "paper": paper, "parts": parts, "verdict": combine([p["verdict"] for p in parts]),
            "note": note}


# ------------------------------------------------------------------------------------------------ per-seed values
def final(report: dict, name: str, key: str) -> dict[str, float]:
    """{seed: final validation `key`} of scheme `name` (NaN where a seed's run lacks it: no verdict, not fewer
    seeds)."""
    for s in report["schemes"]:
        if s["name"] == name:
            return {seed: _number(r["final_eval"].get(key)) for seed, r in s["seeds"].items()}   # none: NaN
    return {}


def _number(x: Optional[float]) -> float:
    """A value as stored (NaN/inf are null in report.json) as a float, NaN for none."""
    return float("nan") if x is None else float(x)


def _paired(a: dict[str, float], b: dict[str, float], fn) -> dict[str, float]:
    return {seed: fn(a[seed], b[seed]) for seed in a if seed in b}


def _names(report: dict, objective: str) -> list[str]:
    return [s["name"] for s in report["schemes"] if s["objective"] == objective]


def _scheme_of_path(report: dict) -> dict[str, str]:
    return {r["path"]: s["name"] for s in report["schemes"] for r in s["seeds"].values()}


def scored_past_training(report: dict) -> bool:
    """Whether every seed's extrapolation scored the training length (model.max_len) and a length above it."""
    train_len = int(report["config"]["model"]["max_len"])
    scored = [[x["length"] for x in run["results"]] for ex in report.get("extrapolation", {}).values()
              for run in ex["runs"]]
    return all(train_len in lengths and max(lengths) > train_len for lengths in scored)


def growth(report: dict) -> dict[str, dict[str, Optional[float]]]:
    """{scheme: {seed: ln ppl(longest) − ln ppl(training length)}}, None where the longest length is not defined,
    or where no growth was scored (`scored_past_training` false: never 0 from the training length against itself)."""
    out: dict[str, dict] = {}
    train_len = int(report["config"]["model"]["max_len"])
    where = _scheme_of_path(report)
    for seed, ex in report.get("extrapolation", {}).items():
        for run in ex["runs"]:
            at = {x["length"]: x for x in run["results"]}
            longest = max(at)
            if train_len not in at or longest <= train_len:
                out.setdefault(where.get(run["workdir"], run["name"]), {})[seed] = None
                continue
            ppl = [_number(at[n].get("perplexity")) for n in (longest, train_len)]   # null in report.json: NaN
            value = ((math.log(ppl[0]) - math.log(ppl[1]) if all(_finite(p) and p > 0 for p in ppl) else float("nan"))
                     if at[longest]["defined"] else None)
            out.setdefault(where.get(run["workdir"], run["name"]), {})[seed] = value
    clm = set(_names(report, "clm"))
    for name, seed in diverged(report) if report.get("extrapolation") else []:   # not analysed: no value, no verdict
        if name in clm:          # (also when every seed of the scheme, or every causal run of the seed, diverged)
            out.setdefault(name, {})[seed] = float("nan")
    return out


def diverged(report: dict) -> list[tuple[str, str]]:
    """(scheme, seed) of the runs whose training diverged (`analysis.suite`: no final values, no analyses)."""
    return [(s["name"], seed) for s in report["schemes"] for seed, r in s["seeds"].items() if r.get("diverged")]


# ------------------------------------------------------------------------------------------------ the findings
def _nopos_findings(report: dict) -> list[dict]:
    out = []
    mlm = _names(report, "mlm")
    if "nopos-mlm" in mlm and "bert_a-mlm" in mlm:
        x = _paired(final(report, "nopos-mlm", "eval_loss"), final(report, "bert_a-mlm", "eval_loss"),
                    lambda a, b: a - b)
        out.append(_finding("Bidirectional NoPos (MLM) falls behind BERT-A", "NoPos Table 4",
                            [_part("val MLM loss, nopos − bert_a", x, "nats")]))
    clm = _names(report, "clm")
    baselines = [n for n in NOPOS_TABLE1 if n in clm]
    if "nopos-clm" in clm and baselines:
        nopos = final(report, "nopos-clm", "eval_loss")
        others = {n: final(report, n, "eval_loss") for n in baselines}
        best = {seed: min(v[seed] for v in others.values()) if all(_finite(v.get(seed)) for v in others.values())
                else float("nan") for seed in nopos if any(seed in v for v in others.values())}   # all, or none
        x = _paired(nopos, best, lambda a, b: math.log(CLOSE_PPL_RATIO) - (a - b))
        out.append(_finding("Causal NoPos perplexity close to the positional models", "NoPos Table 1",
                            [_part(f"ln {CLOSE_PPL_RATIO:.2f} − (ln ppl nopos − ln ppl best of "
                                   f"{', '.join(others)})", x, "nats")],
                            f"'close' = within x{CLOSE_PPL_RATIO:.2f} of the best of the paper's Table 1 models "
                            "(learned, sinusoidal, ALiBi), NoPos Table 2's smallest-model gap"))
    middle, probes = _middle_mads(report), _probe_settings(report)
    if "nopos-clm" in middle:
        chance = middle["nopos-clm"]["chance"]
        x = {seed: PROBE_FRACTION - mad / chance[seed] for seed, mad in middle["nopos-clm"]["mad"].items()}
        out.append(_finding("Causal NoPos hidden states encode absolute position (middle layer)",
                            "NoPos Fig. 2", [_part(f"{PROBE_FRACTION} − MAD / chance MAD", x, "fraction")],
                            "'well below chance' = probe MAD under half the chance MAD" + probes))
    if "nopos-clm" in middle and "alibi-clm" in middle:
        alibi, nopos = middle["alibi-clm"]["mad"], middle["nopos-clm"]["mad"]
        nan = float("nan")              # a seed one of the two lacks: no verdict, not a comparison over fewer seeds
        x = {seed: alibi.get(seed, nan) - nopos.get(seed, nan) for seed in sorted(set(alibi) | set(nopos), key=int)}
        out.append(_finding("Causal NoPos holds more absolute position than ALiBi (middle layer)", "NoPos §5, Fig. 2",
                            [_part("probe MAD alibi − MAD nopos", x, "positions")],
                            "the same probes on both; lower MAD = more position information" + probes))
    return out


def _probe_settings(report: dict) -> str:
    """'; probes of S Adam steps on T training tokens' from the suite's config (a verdict can turn on them), or ''."""
    probe = report.get("config", {}).get("probe", {})
    return (f"; probes of {probe['steps']} Adam steps on {probe['train_tokens']} training tokens"
            if "steps" in probe and "train_tokens" in probe else "")


def _middle_mads(report: dict) -> dict[str, dict[str, dict[str, float]]]:
    """{scheme: {'mad': {seed: its middle layer's probe MAD}, 'chance': {seed: chance MAD}}} for the schemes
    probed; a diverged run's seed is NaN (no verdict). Of layers 0 (embeddings) .. L the middle is (L + 1) // 2."""
    out: dict[str, dict] = {}
    where = _scheme_of_path(report)
    for seed, pr in report.get("probe", {}).items():
        for run in pr["runs"]:
            name = where.get(run["workdir"])
            if name:
                mads = [layer["mad"] for layer in run["layers"]]
                got = out.setdefault(name, {"mad": {}, "chance": {}})
                got["mad"][seed], got["chance"][seed] = mads[len(mads) // 2], run["chance_mad"]
    for name, seed in diverged(report) if "probe" in report else []:
        got = out.setdefault(name, {"mad": {}, "chance": {}})
        got["mad"][seed], got["chance"][seed] = float("nan"), float("nan")
    return out


def _unscored(claim: str, paper: str) -> dict:
    """A growth claim the suite's lengths cannot speak to: shown, with no verdict (not a silent omission)."""
    part = {**_part("growth past the training length", {}, "nats"), "verdict": UNSCORED}
    return {**_finding(claim, paper, [part], "eval.lengths must hold model.max_len and a longer length"),
            "verdict": UNSCORED}


def _extrapolation_findings(report: dict) -> list[dict]:
    g = growth(report)
    if not g:
        return []
    scored = scored_past_training(report)
    defined = {n: v for n, v in g.items() if not scored or all(x is not None for x in v.values())}
    out = []
    if "alibi-clm" in defined and len(defined) > 1:
        claim = ("ALiBi degrades least past the training length", "ALiBi Table 2 / Fig. 1")
        out.append(_finding(*claim, [_part(f"growth {n} − growth alibi", _paired(v, defined["alibi-clm"],
                                                                                lambda a, b: a - b), "nats")
                                     for n, v in defined.items() if n != "alibi-clm"],
                            "growth = ln ppl(longest) − ln ppl(training length), paired by seed")
                   if scored else _unscored(*claim))
    for sin, label in (("sinusoidal-clm", "our scaled table"), ("sinusoidal-clm-fairseq", "fairseq's table")):
        others = [n for n in defined if not n.startswith("sinusoidal")]
        if sin in defined and others:
            claim = (f"Sinusoidal ({label}) degrades most past the training length", "ALiBi Fig. 1")
            out.append(_finding(*claim, [_part(f"growth {sin} − growth {n}", _paired(defined[sin], defined[n],
                                                                                    lambda a, b: a - b), "nats")
                                         for n in others]) if scored else _unscored(*claim))
    clm = _names(report, "clm")
    if "sinusoidal-clm" in clm and "sinusoidal-clm-fairseq" in clm:
        x = _paired(final(report, "sinusoidal-clm-fairseq", "eval_loss"), final(report, "sinusoidal-clm", "eval_loss"),
                    lambda a, b: a - b)
        out.append(_finding("Our scaled sinusoidal table trains better here than fairseq's (design check, not a "
                            "paper claim)", "positional/sinusoidal.py", [_part("val loss fairseq − scaled", x, "nats")]))
    return out


def glue_average(by_task: dict, tasks: list[str]) -> Optional[float]:
    """100 x the mean dev score over the GLUE tasks of `tasks` (word order excluded); None if any is missing or not
    finite (an average over fewer tasks is another average)."""
    real = [by_task.get(t, {}).get("score") for t in tasks if t != "wordorder"]
    return 100 * sum(real) / len(real) if real and all(_finite(x) for x in real) else None


def _glue_average(report: dict, name: str) -> dict[str, float]:
    tasks = report.get("glue_tasks") or sorted({t for runs in report.get("glue", {}).values()
                                                for by_task in runs.values() for t in by_task})
    return {seed: _number(glue_average(by_task, tasks))
            for seed, by_task in report.get("glue", {}).get(name, {}).items()
            if any(t != "wordorder" for t in tasks)}


def _tupe_findings(report: dict) -> list[dict]:
    mlm, out = set(_names(report, "mlm")), []
    loss = {n: final(report, n, "eval_loss") for n in mlm}
    order = [("bert_a-mlm", "tupe_a-mlm"), ("bert_r-mlm", "tupe_r-mlm"), ("bert_a-mlm", "bert_r-mlm"),
             ("tupe_a-mlm", "tupe_r-mlm")]
    pairs = [(worse, better) for worse, better in order if worse in mlm and better in mlm]
    parts = [_part(f"val MLM loss {worse} − {better}", _paired(loss[worse], loss[better], lambda a, b: a - b), "nats")
             for worse, better in pairs]
    if parts:    # the claim names the pairs compared: a suite of two schemes speaks to one of the four
        label = {n: n.split("-")[0].upper().replace("_", "-") for n in mlm}
        named = ", ".join(f"{label[better]} < {label[worse]}" for worse, better in pairs)
        out.append(_finding(f"Validation MLM loss order {named}" + (" (each pair)" if len(pairs) > 1 else ""),
                            "TUPE Fig. 5a", parts))
    if "glue" in report:
        avg = {n: _glue_average(report, n) for n in report["glue"]}
        parts = [_part(f"GLUE avg {a} − {b}", _paired(avg[a], avg[b], lambda x, y: x - y), "points")
                 for a, b in (("tupe_a-mlm", "bert_a-mlm"), ("tupe_r-mlm", "bert_r-mlm")) if a in avg and b in avg]
        if parts:
            out.append(_finding("TUPE fine-tunes better than BERT (GLUE dev average)", "TUPE Table 1", parts))
        if "tupe_a-mlm" in avg and "tupe_a-mlm-tiedcls" in avg:
            x = _paired(avg["tupe_a-mlm"], avg["tupe_a-mlm-tiedcls"], lambda a, b: a - b)
            out.append(_finding("Untying [CLS] helps fine-tuning", "TUPE Table 2 (ablation)",
                                [_part("GLUE avg tupe_a − tupe_a (tied [CLS])", x, "points")]))
    return out


def evaluate(report: dict) -> list[dict]:
    """The findings the suite in `report` can speak to, each with its parts, per-seed values and verdict."""
    return _nopos_findings(report) + _extrapolation_findings(report) + _tupe_findings(report)
