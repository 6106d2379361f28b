"""Behaviour is unchanged by refactors: the loops reproduce `tests/data/behaviour.json` (recorded before the
trainer / run-folder redesign; see tests/behaviour.py) — 20-step float32 losses and final parameters of every
scheme in both families and of a GLUE fine-tune, bitwise on the JAX/XLA stack it was recorded with."""
import json

import pytest

from tests import behaviour as B

GOLDEN = json.load(open(B.GOLDEN, encoding="utf-8"))


def check(kind: str, got: dict) -> None:
    for name, result in got[kind].items():
        want = GOLDEN[kind][name]
        if B.stack() == GOLDEN["stack"]:      # same XLA: every bit must match
            assert result == want, f"{kind} {name} changed (same stack {B.stack()})"
        else:                                 # another XLA may round differently; the numbers must not move
            assert result["losses"] == pytest.approx(want["losses"], rel=1e-5), name
            assert result["params"]["abs_sum"] == pytest.approx(want["params"]["abs_sum"], rel=1e-5), name


def test_golden_covers_every_scheme_and_family():
    assert set(GOLDEN["pretrain"]) == {f"{pe}-{o}" for pe in B.SCHEMES for o in B.OBJECTIVES}
    assert all(len(r["losses"]) == B.STEPS for r in GOLDEN["pretrain"].values())
    # the fingerprint discriminates: schemes that train differently have different parameters
    assert len({r["params"]["sha256"] for r in GOLDEN["pretrain"].values()}) == len(GOLDEN["pretrain"])


def test_two_schemes_and_a_finetune_reproduce_the_golden_run(tmp_path):
    got = B.record(str(tmp_path), schemes=("tupe_r",), objectives=("mlm", "clm"), finetune=True)
    check("pretrain", got)
    check("finetune", got)


@pytest.mark.slow
def test_every_scheme_reproduces_the_golden_run(tmp_path):
    schemes = tuple(s for s in B.SCHEMES if s != "tupe_r")
    check("pretrain", B.record(str(tmp_path), schemes=schemes, finetune=False))
