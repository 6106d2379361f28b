"""Checks made before any compute by the analyses and the compare suite, and the estimators' baselines (from a
review): each refusal names its flag, and nothing is scored or trained before it."""
import json

import pytest

from tupe_jax.analysis import extrapolate as E
from tupe_jax.analysis import suite as suite_lib
from tupe_jax.errors import UserError
from tupe_jax.workdir import gate

from tests.test_analysis import corpus, make_run  # noqa: F401  (the module's fixture, reused)
from tests.test_compare import load


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
