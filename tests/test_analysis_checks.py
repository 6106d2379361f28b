"""Checks made before any compute by the analyses and the compare suite, and the estimators' baselines (from a
review): each refusal names its flag, and nothing is scored or trained before it."""
import pytest

from tupe_jax.analysis import extrapolate as E
from tupe_jax.errors import UserError

from tests.test_analysis import corpus, make_run  # noqa: F401  (the module's fixture, reused)


def test_sliding_with_an_mlm_run_is_refused_before_the_causal_runs_are_scored(corpus, tmp_path, monkeypatch):
    """`--workdir=<clm> --workdir=<mlm> --mode=sliding` scored the causal run in full, then refused the MLM one."""
    runs = [make_run(corpus, "alibi", "clm"), make_run(corpus, "alibi", "mlm")]
    monkeypatch.setattr(E, "evaluate_length", lambda *a, **k: pytest.fail("computed before the check"))
    with pytest.raises(UserError, match=r"^error: --mode=sliding is defined for causal LMs only; '.*alibi-mlm' is an "
                                        r"MLM encoder, --mode, drop --mode .*, or extrapolate the MLM runs apart$"):
        E.run("/unused", [16, 32], mode="sliding", stride=8, out=str(tmp_path), runs=runs)
    assert list(tmp_path.iterdir()) == []
