"""The seed-statistics verdict rule (analysis/findings.py) on constructed numbers, and the findings it derives from a
suite's report dict (paired by seed)."""
import math

import pytest

from tupe_jax.analysis import findings as F


@pytest.mark.parametrize("xs,expected", [
    ([0.3, 0.2, 0.25], F.REPRODUCED),                 # all positive, mean 0.25 > std 0.05
    ([-0.3, -0.2, -0.25], F.CONTRADICTED),
    ([0.3, 0.2, -0.01], F.NO_EVIDENCE),               # one seed disagrees
    ([0.1, 0.9, 0.05], F.NO_EVIDENCE),                # all positive but mean 0.35 < std 0.48
    ([0.3, 0.2], F.TOO_FEW),
    ([0.0, 0.0, 0.0], F.NO_EVIDENCE),
])
def test_verdict_rule(xs, expected):
    assert F.verdict(xs) == expected


def test_mean_std_is_the_sample_std():
    m, s = F.mean_std([1.0, 2.0, 4.0])
    assert m == pytest.approx(7 / 3)
    assert s == pytest.approx(math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2))


def test_combine_needs_every_part():
    assert F.combine([F.REPRODUCED, F.REPRODUCED]) == F.REPRODUCED
    assert F.combine([F.REPRODUCED, F.NO_EVIDENCE]) == F.NO_EVIDENCE
    assert F.combine([F.REPRODUCED, F.CONTRADICTED]) == F.CONTRADICTED


def _scheme(name, objective, losses):
    return {"name": name, "objective": objective,
            "seeds": {str(k): {"path": f"/r/{name}-s{k}", "final_eval": {"eval_loss": v}} for k, v in losses.items()}}


def test_nopos_mlm_finding_is_paired_by_seed():
    # the seed effect (+1 nat for seed 1) is shared by both schemes: paired differences remove it
    report = {"config": {"model": {"max_len": 128}}, "schemes": [
        _scheme("bert_a-mlm", "mlm", {0: 5.0, 1: 6.0, 2: 5.5}),
        _scheme("nopos-mlm", "mlm", {0: 5.1, 1: 6.1, 2: 5.62})]}
    (finding,) = F.evaluate(report)
    part = finding["parts"][0]
    assert part["per_seed"] == pytest.approx({"0": 0.1, "1": 0.1, "2": 0.12})
    assert finding["verdict"] == F.REPRODUCED
    # unpaired, the seed spread (0.5) would swamp the 0.1 difference; reversed, it is contradicted
    report["schemes"][1]["seeds"]["2"]["final_eval"]["eval_loss"] = 5.3
    assert F.evaluate(report)[0]["verdict"] == F.NO_EVIDENCE


def test_extrapolation_growth_and_undefined_tables():
    def ex(seed, runs):
        return {"runs": [{"workdir": f"/r/{n}-s{seed}", "name": n, "results": [
            {"length": 128, "defined": True, "perplexity": a}, {"length": 1024, "defined": b is not None,
                                                                "perplexity": b}]} for n, a, b in runs]}
    report = {"config": {"model": {"max_len": 128}},
              "schemes": [_scheme(n, "clm", {0: 1.0, 1: 1.0, 2: 1.0}) for n in
                          ("alibi-clm", "sinusoidal-clm", "bert_a-clm")],
              "extrapolation": {str(k): ex(k, [("alibi-clm", 50.0, 45.0 + k), ("sinusoidal-clm", 50.0, 400.0 + k),
                                                ("bert_a-clm", 50.0, None)]) for k in range(3)}}
    g = F.growth(report)
    assert g["bert_a-clm"] == {"0": None, "1": None, "2": None}
    assert g["alibi-clm"]["0"] == pytest.approx(math.log(45 / 50))
    by = {f["claim"]: f for f in F.evaluate(report)}
    assert by["ALiBi degrades least past the training length"]["verdict"] == F.REPRODUCED
    assert len(by["ALiBi degrades least past the training length"]["parts"]) == 1   # learned: not defined, left out
    assert by["Sinusoidal (our scaled table) degrades most past the training length"]["verdict"] == F.REPRODUCED


def test_the_majority_row_speaks_each_columns_metric():
    """A constant prediction scores its accuracy on accuracy columns, MCC 0 on CoLA, nothing on STS-B."""
    from tupe_jax.analysis.report import _majority_cell  # pylint: disable=import-outside-toplevel
    assert _majority_cell("sst2", {"majority_baseline": {"accuracy": 0.509}}) == "50.9"
    assert _majority_cell("cola", {"majority_baseline": {"accuracy": 0.691}}) == "0.0"
    assert _majority_cell("stsb", {"majority_baseline": {}}) == "—"


def test_a_diverged_or_missing_value_gives_no_verdict_instead_of_a_smaller_comparison():
    """A NaN baseline loss dropped out of NoPos's "best of" (min() with NaN depends on order), and a missing GLUE
    score made that seed's average one over fewer tasks (its finding moved from 0.83 ± 0.15 to 3.71 ± 5.14)."""
    nan = float("nan")
    report = {"config": {"model": {"max_len": 128}}, "schemes": [
        _scheme("nopos-clm", "clm", {0: 5.0, 1: 5.1, 2: 5.2}), _scheme("alibi-clm", "clm", {0: nan, 1: 5.0, 2: 5.1}),
        _scheme("sinusoidal-clm", "clm", {0: 5.05, 1: 5.15, 2: 5.25})]}
    for order in (report["schemes"], report["schemes"][::-1]):
        (finding,) = F.evaluate({**report, "schemes": order})
        assert finding["verdict"] == F.UNDEFINED and math.isnan(finding["parts"][0]["per_seed"]["0"])
        assert math.isnan(finding["parts"][0]["mean"])
    report["schemes"][1]["seeds"]["0"]["final_eval"]["eval_loss"] = None          # as report.json stores NaN
    assert F.evaluate(report)[0]["verdict"] == F.UNDEFINED
    glue = {"glue_tasks": ["rte", "stsb", "wordorder"], "schemes": [], "config": {"model": {"max_len": 128}},
            "glue": {name: {str(k): {"rte": {"score": 0.6 + d}, "stsb": {"score": 0.8 + d}, "wordorder": {"score": 1}}
                            for k in range(3)} for name, d in (("tupe_a-mlm", 0.01), ("bert_a-mlm", 0.0))}}
    assert F.evaluate(glue)[0]["verdict"] == F.REPRODUCED
    glue["glue"]["tupe_a-mlm"]["1"]["stsb"]["score"] = None                          # a score not written
    (finding,) = F.evaluate(glue)
    assert finding["verdict"] == F.UNDEFINED and math.isnan(finding["parts"][0]["per_seed"]["1"])
    assert F.glue_average(glue["glue"]["tupe_a-mlm"]["1"], glue["glue_tasks"]) is None


def test_one_seed_shows_no_spread():
    """One seed was printed "0.1033 ± 0.0000 nats", as if the seeds agreed exactly."""
    assert math.isnan(F.mean_std([0.1033])[1])
    assert F.mean_spread({"mean": 0.1033, "std": None, "per_seed": {"0": 0.1033}}) == "0.1033"
    assert F.mean_spread({"mean": 0.1, "std": 0.02, "per_seed": {"0": 0.08, "1": 0.12}}) == "0.1000 ± 0.0200"
    assert F.mean_spread({"mean": None, "std": None, "per_seed": {"0": None, "1": 0.1}}) == "— ± —"


def test_a_seed_without_its_final_value_or_with_a_null_perplexity_gives_no_verdict():
    """A seed whose final_eval lacked the key was left out (4 seeds became a 'reproduced' over 3); a perplexity stored
    as null (NaN) made growth() raise inside report.render."""
    report = {"config": {"model": {"max_len": 128}}, "schemes": [
        _scheme("bert_a-mlm", "mlm", {0: 5.0, 1: 6.0, 2: 5.5, 3: 5.2}),
        _scheme("nopos-mlm", "mlm", {0: 5.1, 1: 6.1, 2: 5.62, 3: 5.3})]}
    report["schemes"][1]["seeds"]["3"]["final_eval"] = {}
    assert F.evaluate(report)[0]["verdict"] == F.UNDEFINED
    report = {"config": {"model": {"max_len": 128}},
              "schemes": [_scheme(n, "clm", {0: 1.0}) for n in ("alibi-clm", "rope-clm")],
              "extrapolation": {"0": {"runs": [{"workdir": f"/r/{n}-s0", "name": n, "results": [
                  {"length": 128, "defined": True, "perplexity": 50.0},
                  {"length": 1024, "defined": True, "perplexity": p}]} for n, p in (("alibi-clm", None),
                                                                                   ("rope-clm", 60.0))]}}}
    assert math.isnan(F.growth(report)["alibi-clm"]["0"])
    assert F.evaluate(report)[0]["verdict"] == F.UNDEFINED


@pytest.mark.parametrize("gone", [[("nopos-clm", s) for s in "012"],
                                  [(n, "2") for n in ("alibi-clm", "nopos-clm", "rope-clm")]])
def test_diverged_runs_give_no_verdict_when_a_whole_scheme_or_seed_is_gone(gone):
    """Every seed of one scheme, or every causal run of one seed, diverged: the analyses had nothing of them, and
    the extrapolation finding was judged on the rest ("reproduced")."""
    def ex(seed, names):
        return {"runs": [{"workdir": f"/r/{n}-s{seed}", "name": n, "results": [
            {"length": 128, "defined": True, "perplexity": 10.0}, {"length": 1024, "defined": True,
                                                                   "perplexity": 12.0 if n == "alibi-clm" else 30.0}]}
            for n in names if (n, seed) not in gone]}
    names = ("alibi-clm", "nopos-clm", "rope-clm")
    report = {"config": {"model": {"max_len": 128}}, "schemes": [_scheme(n, "clm", {0: 4.0, 1: 4.0, 2: 4.0})
                                                                  for n in names]}
    for s in report["schemes"]:
        for seed, run in s["seeds"].items():
            if (s["name"], seed) in gone:
                run.update(diverged="training diverged at step 4 (loss=nan)", final_eval={})
    report["extrapolation"] = {seed: ex(seed, names) for seed in "012" if ex(seed, names)["runs"]}
    (finding,) = [f for f in F.evaluate(report) if "ALiBi" in f["claim"]]
    assert finding["verdict"] == F.UNDEFINED
    for s in report["schemes"]:      # the same numbers, no run diverged: reproduced (the test can tell)
        for run in s["seeds"].values():
            run.pop("diverged", None)
    gone.clear()
    report["extrapolation"] = {seed: ex(seed, names) for seed in "012"}
    assert [f for f in F.evaluate(report) if "ALiBi" in f["claim"]][0]["verdict"] == F.REPRODUCED


@pytest.mark.parametrize("names,claim,pairs", [
    (("bert_a-mlm", "tupe_a-mlm"), "Validation MLM loss order TUPE-A < BERT-A", 1),
    (("bert_a-mlm", "tupe_a-mlm", "bert_r-mlm", "tupe_r-mlm"), "Validation MLM loss order TUPE-A < BERT-A, "
     "TUPE-R < BERT-R, BERT-R < BERT-A, TUPE-R < TUPE-A (each pair)", 4),
])
def test_the_tupe_loss_order_claims_the_pairs_it_compares(names, claim, pairs):
    """A suite of BERT-A and TUPE-A was reported as "TUPE-R < TUPE-A, BERT-R < BERT-A (each pair)": two pairs it
    had not run, and not the one it had."""
    report = {"config": {"model": {"max_len": 128}},
              "schemes": [_scheme(n, "mlm", {0: 5.0 - 0.1 * i, 1: 5.5 - 0.1 * i}) for i, n in enumerate(names)]}
    (finding,) = F.evaluate(report)
    assert finding["claim"] == claim and len(finding["parts"]) == pairs


def _probed(mads: dict, chance: float = 42.0, gone=(), probe=None):
    """A probe suite's report: scheme -> {seed: per-layer MADs}; `gone` (scheme, seed) diverged (not probed);
    `probe` the suite's probe settings (config.probe)."""
    report = {"config": {"model": {"max_len": 128}, **({"probe": probe} if probe else {})},
              "schemes": [_scheme(n, "clm", {int(k): 4.0 for k in by_seed}) for n, by_seed in mads.items()]}
    for s in report["schemes"]:
        for seed, run in s["seeds"].items():
            if (s["name"], seed) in gone:
                run.update(diverged="training diverged", final_eval={})
    seeds = sorted({seed for by_seed in mads.values() for seed in by_seed})
    report["probe"] = {seed: {"runs": [{"workdir": f"/r/{n}-s{seed}", "name": n, "chance_mad": chance,
                                        "layers": [{"layer": i, "mad": m} for i, m in enumerate(by_seed[seed])]}
                                       for n, by_seed in mads.items() if seed in by_seed and (n, seed) not in gone]}
                       for seed in seeds}
    return {f["claim"]: f for f in F.evaluate(report)}


def test_the_probe_findings_read_the_middle_layer_paired_by_seed():
    """Layers 0..L: the middle is (L + 1) // 2, not the embeddings or the last. NoPos against ALiBi is paired by
    seed (a seed effect of 4 positions shared by both would swamp a 1-position difference unpaired)."""
    nopos = {s: [41.0, 30.0 + 4 * k, 20.0] for k, s in enumerate("012")}
    alibi = {s: [41.0, 31.0 + 4 * k + 0.1 * k, 40.0] for k, s in enumerate("012")}
    by = _probed({"nopos-clm": nopos, "alibi-clm": alibi})
    absolute = by["Causal NoPos hidden states encode absolute position (middle layer)"]["parts"][0]
    assert absolute["per_seed"] == pytest.approx({"0": 0.5 - 30 / 42, "1": 0.5 - 34 / 42, "2": 0.5 - 38 / 42})
    versus = by["Causal NoPos holds more absolute position than ALiBi (middle layer)"]
    assert versus["parts"][0]["per_seed"] == pytest.approx({"0": 1.0, "1": 1.1, "2": 1.2})
    assert versus["parts"][0]["unit"] == "positions" and versus["verdict"] == F.REPRODUCED
    assert _probed({"nopos-clm": alibi, "alibi-clm": nopos})[versus["claim"]]["verdict"] == F.CONTRADICTED
    five = {s: [41.0, 50.0, 30.0 + k, 50.0, 50.0] for k, s in enumerate("012")}     # L = 4: layer 2
    assert _probed({"nopos-clm": five})["Causal NoPos hidden states encode absolute position (middle layer)"][
        "parts"][0]["per_seed"] == pytest.approx({s: 0.5 - (30 + k) / 42 for k, s in enumerate("012")})


def test_the_probe_findings_give_no_verdict_for_a_diverged_run_and_need_both_schemes():
    nopos = {s: [41.0, 30.0, 20.0] for s in "012"}
    alibi = {s: [41.0, 33.0, 30.0] for s in "012"}
    by = _probed({"nopos-clm": nopos, "alibi-clm": alibi}, gone=[("alibi-clm", "1")])
    versus = by["Causal NoPos holds more absolute position than ALiBi (middle layer)"]
    assert versus["verdict"] == F.UNDEFINED and math.isnan(versus["parts"][0]["per_seed"]["1"])
    assert by["Causal NoPos hidden states encode absolute position (middle layer)"]["verdict"] == F.CONTRADICTED
    alone = _probed({"nopos-clm": nopos})
    assert list(alone) == ["Causal NoPos hidden states encode absolute position (middle layer)"]
    assert _probed({"alibi-clm": alibi}) == {}
    every = _probed({"nopos-clm": nopos}, gone=[("nopos-clm", s) for s in "012"])
    assert every["Causal NoPos hidden states encode absolute position (middle layer)"]["verdict"] == F.UNDEFINED


def test_a_seed_probed_for_one_scheme_only_gives_no_verdict_and_the_notes_name_the_probes():
    """ALiBi probed in seeds 0–3 and NoPos in 0–2 was judged over 0–2; the verdict also turns on the probes' length
    (300-step probes put ALiBi below NoPos in one seed), which the finding now says."""
    nopos = {s: [41.0, 30.0, 20.0] for s in "012"}
    alibi = {s: [41.0, 33.0, 30.0] for s in "0123"}
    by = _probed({"nopos-clm": nopos, "alibi-clm": alibi}, probe={"steps": 30000, "train_tokens": 524288})
    versus = by["Causal NoPos holds more absolute position than ALiBi (middle layer)"]
    assert list(versus["parts"][0]["per_seed"]) == ["0", "1", "2", "3"] and versus["verdict"] == F.UNDEFINED
    for claim in (versus["claim"], "Causal NoPos hidden states encode absolute position (middle layer)"):
        assert by[claim]["note"].endswith("; probes of 30000 Adam steps on 524288 training tokens")
    del alibi["3"]
    assert _probed({"nopos-clm": nopos, "alibi-clm": alibi})[versus["claim"]]["verdict"] == F.REPRODUCED
