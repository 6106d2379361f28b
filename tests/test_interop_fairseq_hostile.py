"""import-fairseq against checkpoints a review built to break it: non-finite weights (an fp16 run that overflowed),
a dict.txt with a symbol twice, and a fine-tune's checkpoint holding numpy scalars (the TUPE code's STS-B best)."""
import os

import numpy as np
import pytest

pytest.importorskip("torch", reason="the fairseq extra (pip install -e '.[test]') brings torch")
pytest.importorskip("sacremoses", reason="the fairseq extra brings sacremoses")
pytest.importorskip("subword_nmt", reason=".[test] brings subword-nmt (the independent BPE reference)")

import launch  # noqa: E402
from tests import fairseq_fixtures as F  # noqa: E402
from tests.test_interop_fairseq import one_line_error  # noqa: E402

ENCODER = "decoder.sentence_encoder."


@pytest.mark.parametrize("name,value,count", [(f"{ENCODER}layers.0.fc1.bias", np.nan, None),
                                              (f"{ENCODER}pos.weight", np.inf, None),
                                              (f"{ENCODER}embed_tokens.weight", np.nan, 1)])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, capsys, name, value, count):
    """They imported (rc 0); a NaN in the tied embedding was called 'differs from the token embedding'."""
    weights = F.write_checkpoint(str(tmp_path / "clean"))
    bad = weights[name].copy()
    if count is None:
        bad[...] = value
    else:
        bad.flat[7] = value
    F.write_checkpoint(str(tmp_path / "ckpt"), tensors={name: bad})
    err = one_line_error(capsys, ["import-fairseq", f"--from={tmp_path / 'ckpt'}", f"--workdir={tmp_path / 'run'}"])
    shown = name if "embed_tokens" not in name else "decoder.lm_head.weight"   # the tied output layer: the same tensor
    assert shown in err and f"holds {count or bad.size} non-finite value(s) (NaN or inf)" in err, err
    assert not (tmp_path / "run").exists()


def test_a_symbol_twice_in_dict_txt_is_named_with_its_lines(tmp_path, capsys):
    """The error named the BPE codes file."""
    lines = F.sentences()
    codes = F.learn_codes(lines)
    rows = F.make_dict(lines, codes).splitlines()
    F.write_checkpoint(str(tmp_path / "ckpt"), codes=codes, dict_txt="\n".join(rows + [rows[2]]) + "\n")
    err = one_line_error(capsys, ["import-fairseq", f"--from={tmp_path / 'ckpt'}", f"--workdir={tmp_path / 'run'}"])
    assert f"line {len(rows) + 1} of {tmp_path / 'ckpt' / 'dict.txt'} repeats the symbol " in err
    assert "of line 3, " in err, err
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_holding_numpy_scalars_imports(tmp_path, capsys):
    """The TUPE code's STS-B fine-tunes keep scipy's pearsonr, a numpy float64, as their best metric in extra_state;
    the safe load refused it as 'not on the allowlist' and said to give the checkpoint as the TUPE code saved it."""
    F.write_checkpoint(str(tmp_path / "ckpt"), extra={"extra_state": {"val_loss": np.float64(0.87),
                                                                      "best": np.float32(0.9)}})
    assert launch.main(["import-fairseq", f"--from={tmp_path / 'ckpt'}", f"--workdir={tmp_path / 'run'}"]) == 0
    assert os.path.isfile(tmp_path / "run" / "config.json")
