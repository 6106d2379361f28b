"""Checks made before any compute by the analyses and the compare suite, and the estimators' baselines (from a
review): each refusal names its flag, and nothing is scored or trained before it."""
import dataclasses
import json

import numpy as np
import pytest

from tupe_jax.analysis import common, correlations as C, extrapolate as E, findings, probe as P
from tupe_jax.analysis import report as report_lib
from tupe_jax.analysis import suite as suite_lib
from tupe_jax.errors import UserError
from tupe_jax.workdir import gate

from tests import test_analysis
from tests.test_analysis import MAX_LEN, make_run
from tests.test_compare import load

corpus = test_analysis.corpus        # that module's fixture, reused here


def test_sliding_with_an_mlm_run_is_refused_before_the_causal_runs_are_scored(corpus, tmp_path, monkeypatch):
    """`--workdir=<clm> --workdir=<mlm> --mode=sliding` scored the causal run in full, then refused the MLM one."""
    runs = [make_run(corpus, "alibi", "clm"), make_run(corpus, "alibi", "mlm")]
    monkeypatch.setattr(E, "evaluate_length", lambda *a, **k: pytest.fail("computed before the check"))
    with pytest.raises(UserError, match=r"^error: --mode=sliding is defined for causal LMs only; '.*alibi-mlm' is an "
                                        r"MLM encoder, --mode, drop --mode .*, or extrapolate the MLM runs apart$"):
        E.run("/unused", [16, 32], mode="sliding", stride=8, out=str(tmp_path), runs=runs)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------ compare suites
@pytest.mark.parametrize("overrides,needle", [
    ({"eval.mode": "sliding"}, r"eval.mode=sliding needs a positive eval.stride .*, --config.eval.stride, "),
    ({"eval.mode": "sliding", "eval.stride": -4}, r"needs a positive eval.stride \(it is -4;"),
    ({"eval.stride": 32}, r"eval.stride = 32 is read by eval.mode=sliding only .*, --config.eval.stride, ")])
def test_a_suites_sliding_windows_need_a_stride_and_a_stride_needs_them(overrides, needle):
    """`--config.eval.mode=sliding` scored nonoverlapping windows (no stride reached extrapolate) under the heading
    'sliding windows'."""
    with pytest.raises(UserError, match=needle):
        suite_lib.validate(load("suite=extrapolation", **overrides), 8)


def test_a_suites_stride_reaches_the_extrapolation(monkeypatch, tmp_path):
    config = load("suite=extrapolation", schemes="alibi", **{"eval.mode": "sliding", "eval.stride": 64})
    suite_lib.validate(config, 8)
    seen = {}
    monkeypatch.setattr(suite_lib.extrapolate, "run", lambda paths, lengths, **kw: seen.update(kw) or {})
    suite_lib._analyses(config, suite_lib.parse_schemes(config), [{"path": str(tmp_path / "r")}], str(tmp_path))
    assert seen["mode"] == "sliding" and seen["stride"] == 64


def test_a_suite_folder_made_before_eval_stride_reruns_unchanged(tmp_path):
    """config.json of a suite made before the key existed reads as eval.stride = 0: no change to refuse or record."""
    config = load("suite=extrapolation")
    gate.write_config(str(tmp_path), config)
    stored = json.loads((tmp_path / "config.json").read_text())
    del stored["eval"]["stride"]
    (tmp_path / "config.json").write_text(json.dumps(stored))
    assert gate.check_config(str(tmp_path), config) == []
    sliding = load("suite=extrapolation", **{"eval.mode": "sliding", "eval.stride": 8})    # resumable: recorded
    assert gate.check_config(str(tmp_path), sliding) == [("eval.mode", "nonoverlapping", "sliding"),
                                                         ("eval.stride", 0, 8)]


def test_an_extrapolation_suite_without_a_causal_scheme_is_refused_before_any_training(tmp_path, monkeypatch):
    """suite=extrapolation with only MLM schemes trained every run, then wrote no extrapolation without a word."""
    monkeypatch.setattr(suite_lib, "pretrain", lambda *a: pytest.fail("trained before the check"))
    config = load("suite=extrapolation", schemes="alibi-mlm,bert_a-mlm")
    with pytest.raises(UserError, match=r"^error: suite=extrapolation scores causal LMs only and schemes "
                                        r"'alibi-mlm,bert_a-mlm' has none: .*, --config.schemes, add a causal scheme"):
        suite_lib.run(config, str(tmp_path / "cmp"))
    assert list(tmp_path.iterdir()) == []
    suite_lib.validate(load("suite=extrapolation", schemes="alibi-mlm,rope-clm"), 8)   # one causal scheme: scored


@pytest.mark.parametrize("lengths,needle", [("(64,128)", r"has no length above the training length model.max_len = "
                                                          r"128: nothing past it would be scored"),
                                            ("(256,)", r"lacks the training length model.max_len = 128: .*"),
                                            ("(64,256)", r"lacks the training length model.max_len = 128: .*")])
def test_extrapolation_lengths_must_hold_the_training_length_and_a_longer_one(lengths, needle):
    """(64,128) at max_len 128 gave 'ALiBi degrades least past the training length: no evidence' from growths of
    exactly 0; (256) or (64,256) dropped the finding without a word."""
    config = load("suite=extrapolation", **{"eval.lengths": lengths})
    with pytest.raises(UserError, match=rf"^error: eval.lengths = .*{needle}, --config.eval.lengths, write e.g. "
                                        r"'\(128,256,512\)'$"):
        suite_lib.validate(config, 8)
    suite_lib.validate(load("suite=tupe", **{"eval.lengths": lengths}), 8)     # read by suite=extrapolation only


def _growth_report(lengths, max_len=128):
    def run(name, seed):
        return {"workdir": f"/r/{name}-s{seed}", "name": name, "results": [
            {"length": n, "defined": True, "perplexity": 50.0 + n / 64 * (1 if name == "alibi-clm" else 3)}
            for n in lengths]}
    names = ("alibi-clm", "rope-clm", "sinusoidal-clm")
    return {"config": {"model": {"max_len": max_len}},
            "schemes": [{"name": n, "objective": "clm", "seeds": {str(k): {"path": f"/r/{n}-s{k}", "final_eval": {
                "eval_loss": 4.0}} for k in range(3)}} for n in names],
            "extrapolation": {str(k): {"lengths": list(lengths), "runs": [run(n, k) for n in names]} for k in range(3)}}


@pytest.mark.parametrize("lengths", [(64, 128), (256,), (64, 256)])
def test_growth_unscored_past_the_training_length_is_no_verdict_not_zero_or_silence(lengths):
    report = _growth_report(lengths)
    assert all(v is None for by_seed in findings.growth(report).values() for v in by_seed.values())
    by = {f["claim"]: f for f in findings.evaluate(report)}
    for claim in ("ALiBi degrades least past the training length",
                  "Sinusoidal (our scaled table) degrades most past the training length"):
        assert by[claim]["verdict"] == findings.UNSCORED, claim
    assert findings.UNSCORED in "\n".join(report_lib._findings({"findings": list(by.values())}))
    scored = {f["claim"]: f for f in findings.evaluate(_growth_report((128, 512)))}     # bracketed: judged
    assert scored["ALiBi degrades least past the training length"]["verdict"] == findings.REPRODUCED


# ------------------------------------------------------------------------------------------------ estimators
@pytest.mark.parametrize("batch", [2, 8, 64])
def test_structured_fraction_is_zero_for_noise_and_one_for_a_positional_pattern(batch):
    """The batch-mean variance over the total had a floor of ~1/B: iid noise gave 0.126 at B = 8, 0.015 at B = 64.
    Tolerance 0.03: the estimate's spread over seeds is 0.006 at B = 8 with 2 heads x 528 causal cells."""
    rng = np.random.default_rng(batch)
    pattern = rng.normal(size=(1, 2, 32, 32))
    for causal in (True, False):
        def fraction(x):
            return C.noise_stats({"word-word": x}, causal)["word-word"]["structured_fraction"]
        assert fraction(rng.normal(size=(batch, 2, 32, 32))) == pytest.approx(0.0, abs=0.03)
        assert fraction(np.repeat(pattern, batch, 0)) == pytest.approx(1.0, abs=1e-9)
        assert fraction(pattern + 0.05 * rng.normal(size=(batch, 2, 32, 32))) == pytest.approx(1.0, abs=0.01)
        assert fraction(pattern + rng.normal(size=(batch, 2, 32, 32))) == pytest.approx(0.5, abs=0.1)
    assert C.noise_stats({"word": rng.normal(size=(1, 2, 4, 4))}, False)["word"]["structured_fraction"] is None


@pytest.mark.parametrize("n", [7, 32, 128])
def test_the_median_constant_baseline_is_the_best_constant_guess(n):
    """Chance, (n²−1)/(3n), is a uniformly random guess; predicting the median everywhere scores about n/4, so a MAD
    between the two shows no position information."""
    positions = np.tile(np.arange(n), 3)
    best = min(np.abs(positions - c).mean() for c in range(n))
    assert P.median_mad(positions) == pytest.approx(best, abs=1e-12) and best < P.chance_mad(n)
    assert P.median_mad(np.arange(1, n)) == pytest.approx(min(np.abs(np.arange(1, n) - c).mean() for c in range(n)))
    if n % 2 == 0:
        assert P.median_mad(positions) == n / 4


def test_mlm_probes_leave_cls_at_position_0_out_and_report_both_baselines(corpus, tmp_path, monkeypatch):
    """[CLS] always sits at index 0 of an MLM window: a probe read the token and got position 0 for free."""
    seen = {}

    def train(tx, ty, ex, ey, n, settings):
        seen.setdefault("y", []).append((np.unique(ty), np.unique(ey), tx.shape[1], ex.shape[1]))
        return [{"layer": i, "mad": 1.0, "accuracy": 0.0, "train_loss": 0.0} for i in range(tx.shape[0])]
    monkeypatch.setattr(P, "train_probes", train)
    runs = [make_run(corpus, "nopos", "mlm"), make_run(corpus, "alibi", "clm")]
    report = P.run("/unused", out=str(tmp_path), runs=runs,
                   settings=P.ProbeSettings(steps=1, train_tokens=64, eval_tokens=64))
    (mlm_train, mlm_eval, *_), (clm_train, clm_eval, *_) = seen["y"]
    assert list(mlm_train) == list(mlm_eval) == list(range(1, MAX_LEN))
    assert list(clm_train) == list(clm_eval) == list(range(MAX_LEN))
    mlm, clm = report["runs"]
    assert (mlm["first_position"], clm["first_position"]) == (1, 0)
    assert mlm["chance_mad"] == P.chance_mad(MAX_LEN - 1) and clm["chance_mad"] == P.chance_mad(MAX_LEN)
    assert mlm["median_mad"] == P.median_mad(np.arange(1, MAX_LEN)) and clm["median_mad"] == MAX_LEN / 4
    saved = json.loads((tmp_path / "probe.json").read_text())
    assert saved["runs"][0]["median_mad"] == mlm["median_mad"] and "median" in saved["protocol"]


def test_a_suite_report_shows_the_median_baseline_beside_chance_when_its_probes_wrote_one(tmp_path):
    def scheme(name):
        return {"name": name, "objective": "clm", "seeds": {"0": {"path": f"/r/{name}"}}}
    run = {"workdir": "/r/nopos-clm", "name": "nopos-clm", "chance_mad": 10.66, "median_mad": 8.0,
           "layers": [{"mad": 9.0}, {"mad": 3.0}]}
    report = {"config": {"probe": {"steps": 1, "train_tokens": 64, "eval_tokens": 64}},
              "schemes": [scheme("nopos-clm")], "probe": {"0": {"runs": [run]}}}
    text = "\n".join(report_lib._probe(report, str(tmp_path)))
    assert "| chance | median |" in text and "| 10.7 | 8.0 |" in text and "median position everywhere" in text
    del run["median_mad"]                           # a probe made before the baseline: the table it had
    text = "\n".join(report_lib._probe(report, str(tmp_path)))
    assert "median" not in text and text.rstrip().endswith("| 10.7 |")


def test_the_probe_suite_trains_the_sweeps_near_converged_probes_with_fewer_tokens_on_wide_models():
    """The suite's probes were 300 steps on 16384 tokens, far from converged (docs/experiments/probe-sweep); at
    base width 524288 tokens of features would be 21 GB a copy."""
    tiny, base = load("suite=probe").probe, load("suite=probe,size=base").probe
    assert (tiny.steps, tiny.train_tokens, tiny.learning_rate) == (30000, 524288, 2e-3)
    assert (base.steps, base.train_tokens) == (30000, 131072)


def test_windows_drawn_beyond_the_split_say_that_they_repeat(corpus, capsys):
    """The suite's probes draw 524288 training tokens: a smaller corpus's windows repeated without a word."""
    run = make_run(corpus, "bert_a", "clm")
    n = len(common.token_stream(run, "validation")) // MAX_LEN
    every = common.model_windows(run, "validation", MAX_LEN, count=n)
    assert "repeat" not in capsys.readouterr().out
    more = common.model_windows(run, "validation", MAX_LEN, count=n + 3)
    assert f"the validation split holds {n} windows of {MAX_LEN} tokens; the {n + 3} drawn repeat" in \
        capsys.readouterr().out
    assert {r.tobytes() for r in more} == {r.tobytes() for r in every} and len(every) == n


# ------------------------------------------------------------------------------------------------ probe-length sweep
def _probe_sweep():
    """tools/probe_sweep.py as a module (tools/ is not a package)."""
    import importlib  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    tools = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    return importlib.import_module("probe_sweep")

def test_a_probe_sweep_cell_is_the_probe_launch_probe_trains_at_those_settings(corpus, tmp_path):
    """tools/probe_sweep.py draws the features once, for its largest token count, and slices them per cell: each
    cell must be the very probe `launch probe` trains with those settings (same windows, same fit), for a causal
    run and for an MLM run (whose windows hold one position fewer)."""
    probe_sweep = _probe_sweep()
    base, runs = P.ProbeSettings(eval_tokens=256), []
    for run in (make_run(corpus, "bert_a", "clm"), make_run(corpus, "nopos", "mlm")):
        swept = probe_sweep.sweep_run(run, [15, 30], [100, 400], base)
        assert [(c["steps"], c["train_tokens"]) for c in swept["cells"]] == [(15, 100), (30, 100), (15, 400),
                                                                               (30, 400)]
        for cell in swept["cells"]:
            alone = P.probe_run(run, P.ProbeSettings(steps=cell["steps"], train_tokens=cell["train_tokens"],
                                                     eval_tokens=256))
            assert cell["tokens_used"] == alone["train_tokens"]
            assert [x["mad"] for x in cell["layers"]] == [x["mad"] for x in alone["layers"]]
            assert [x["train_loss"] for x in cell["layers"]] == pytest.approx(
                [x["train_loss"] for x in alone["layers"]], rel=1e-6, abs=0)
        assert swept["chance_mad"] == alone["chance_mad"] and swept["median_mad"] == alone["median_mad"]
        runs.append(swept)
    result = {"command": "x", "settings": dataclasses.asdict(base), "grid": {"steps": [15, 30], "train_tokens":
                                                                            [100, 400]}, "runs": runs}
    result["summary"] = probe_sweep.summary(runs)
    probe_sweep.plot(result, tmp_path / "sweep.png")
    report = probe_sweep.markdown(result)
    assert (tmp_path / "sweep.png").stat().st_size > 1000
    assert "| `bert_a-clm` | 400 | 30 | " in report and "| `nopos-mlm` | 100 | 15 | " in report
    assert "MAD by true position in the largest cell (30 steps, 400 tokens)" in report


def test_the_probe_sweep_summary_is_the_mean_and_std_over_a_schemes_seeds():
    probe_sweep = _probe_sweep()
    assert probe_sweep.scheme_of("nopos-clm-s12") == "nopos-clm" and probe_sweep.scheme_of("x-sy") == "x-sy"
    runs = [{"scheme": "a", "chance_mad": 10.0, "cells": [{"steps": 5, "train_tokens": 7,
                                                          "layers": [{"mad": m}, {"mad": 2 * m}]}]}
            for m in (1.0, 2.0, 6.0)]
    rows = probe_sweep.summary(runs)
    assert [(r["layer"], r["mad_mean"], r["fraction_of_chance_mean"]) for r in rows] == [(0, 3.0, 0.3),
                                                                                       (1, 6.0, 0.6)]
    assert rows[0]["mad_std"] == pytest.approx(np.std([1.0, 2.0, 6.0], ddof=1))


def test_segment_mads_split_the_positions_into_equal_ranges_whose_mads_average_to_the_mad():
    truth = np.tile(np.arange(1, 33), 5)                            # an MLM's positions 1..32, five windows
    pred = np.where(truth < 9, truth, 20)                          # exact at the start, a constant after
    segs = P.segment_mads(pred, truth, 4)
    assert [(a, b) for a, b, _ in segs] == [(1, 8), (9, 16), (17, 24), (25, 32)]
    assert [m for _, _, m in segs] == [0.0, 7.5, 2.0, 8.5]
    assert np.mean([m for _, _, m in segs]) == np.abs(pred - truth).mean()
    assert [(a, b) for a, b, _ in P.segment_mads(truth, truth % 3, 8)] == [(0, 0), (1, 1), (2, 2)]


def test_the_probe_sweep_refuses_nothing_to_probe_and_a_render_without_its_json(tmp_path):
    probe_sweep = _probe_sweep()
    for argv, line in ((["--out", str(tmp_path)], "error: no run to probe, --workdir, give one --workdir per "
                                                  "pretraining run"),
                       (["--render", "--out", str(tmp_path)], f"error: --render redraws {tmp_path}/sweep.json and "
                        "trains nothing, --render, point --out at a folder holding a sweep.json"),
                       (["--steps", "300,x", "--workdir", "r"], "error: --steps=300,x is not a list of positive "
                        "integers, --steps, give e.g. --steps=300,1000"),
                       (["--learning_rate", "0", "--workdir", "r"], "error: --learning_rate=0.0 must be positive, "
                        "--learning_rate, give e.g. 2e-3")):      # before the runs are read ('r' is no run)
        with pytest.raises(SystemExit) as err:
            probe_sweep.main(argv)
        assert str(err.value) == line
    assert list(tmp_path.iterdir()) == []
