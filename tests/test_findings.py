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
