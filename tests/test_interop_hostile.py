"""Hugging Face folders a hostile review (session 41) imported wrongly or crashed on: each now refused in one line
before the weights are read where it can be, or imported with what it is said. The `.bin` conversion the refusal
suggests keeps a headless checkpoint headless; a null position type or untied output layer (what transformers does
with null) is refused; renamed specials in special_tokens_map.json and a tokenizer.json that disagrees with vocab.txt
are refused; NaN weights are refused (evaluate scored them 1.0); an import's untrained head stays marked through
export and import; malformed values are one line, not a traceback."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[test]') brings transformers")

import launch  # noqa: E402
from tests import hf_fixtures as F  # noqa: E402
from tests.test_interop_inputs import VOCAB, copy, refused  # noqa: E402
from tupe_jax.interop import safetensors_io  # noqa: E402


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_hostile")
    F.save_hf_bert(root / "hf", VOCAB)
    return root / "hf"


@pytest.mark.parametrize("config,needle", [
    ({"position_embedding_type": None}, "position_embedding_type=None"),
    ({"tie_word_embeddings": None}, "tie_word_embeddings=None"),
    ({"model_type": "roberta", "architectures": 5}, "a 'roberta' model (architectures: 5), not BERT"),
    ({"architectures": [1]}, None),                                  # a BERT: the odd list is only shown
    ({"num_hidden_layers": 10 ** 12}, "num_hidden_layers=1000000000000"),
])
def test_config_values_transformers_reads_otherwise_are_refused(hf, tmp_path, capsys, config, needle):
    if needle is None:
        assert launch.main(["import-hf", f"--from={copy(hf, tmp_path / 'x', config)}",
                            f"--workdir={tmp_path / 'run'}"]) == 0
        return
    refused(capsys, tmp_path, copy(hf, tmp_path / "x", config), needle)


def test_the_config_and_tokenizer_are_refused_before_the_weights_are_read(hf, tmp_path, capsys, monkeypatch):
    """A RoBERTa of 600 MB was read whole into float32 (31 s, 3.1 GB) before "not BERT"."""
    def unread(*args, **kwargs):
        raise AssertionError("the weights were read")
    monkeypatch.setattr(safetensors_io, "read", unread)
    refused(capsys, tmp_path, copy(hf, tmp_path / "roberta", {"model_type": "roberta"}), "not BERT")
    refused(capsys, tmp_path, copy(hf, tmp_path / "gelu", {"hidden_act": "gelu_new"}), "hidden_act='gelu_new'")
    os.remove(copy(hf, tmp_path / "novocab") / "vocab.txt")
    refused(capsys, tmp_path, tmp_path / "novocab", "has no vocab.txt")


def test_tokenizer_files_that_transformers_reads_otherwise_are_refused(hf, tmp_path, capsys):
    renamed = copy(hf, tmp_path / "renamed")
    (renamed / "special_tokens_map.json").write_text(json.dumps({"mask_token": "[unused5]", "cls_token": "[CLS]"}))
    refused(capsys, tmp_path, renamed, "special_tokens_map.json names mask_token '[unused5]', not '[MASK]'")
    table = {t: i for i, t in enumerate(VOCAB)}
    kitten = {("kitten" if t == VOCAB[1] else t): i for t, i in table.items()}     # one line renamed
    for name, words, needle in (("kitten", kitten, "'kitten' has id 1 there, None in vocab.txt"),
                                ("short", dict(list(table.items())[:-1]), f"{len(VOCAB) - 1} tokens, vocab.txt "
                                                                          f"{len(VOCAB)}")):
        folder = copy(hf, tmp_path / name)
        (folder / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordPiece", "vocab": words}}))
        refused(capsys, tmp_path, folder, f"tokenizer.json's vocabulary differs from vocab.txt ({needle})")
    odd = copy(hf, tmp_path / "odd")
    (odd / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 5, "content": {"a": 1}}]}))
    refused(capsys, tmp_path, odd, "adds 1 token(s) beyond vocab.txt")
    same = copy(hf, tmp_path / "same")                        # the fast tokenizer of this very vocab.txt: imported
    (same / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordPiece", "vocab": table}}))
    assert launch.main(["import-hf", f"--from={same}", f"--workdir={tmp_path / 'ok'}"]) == 0


def test_non_finite_weights_are_refused(hf, tmp_path, capsys):
    """An import of NaN weights succeeded, and `evaluate` printed eval_mlm_accuracy 1.0000."""
    from safetensors.numpy import load_file, save_file
    folder = copy(hf, tmp_path / "nan")
    tensors = load_file(str(folder / "model.safetensors"))
    name = sorted(tensors)[3]
    tensors[name] = tensors[name].copy()
    tensors[name].flat[:2] = [np.nan, np.inf]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "flax"})
    refused(capsys, tmp_path, folder, "holds 2 non-finite value(s) (NaN or inf)")


def test_a_file_given_as_workdir_is_named_so(hf, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert launch.main(["import-hf", f"--from={hf}", f"--workdir={tmp_path / 'file'}"]) == 2
    assert f"error: {tmp_path / 'file'} is a file, --workdir" in capsys.readouterr().err


@pytest.mark.slow   # a torch BertModel saved as .bin, converted, imported, exported and imported again
def test_a_headless_bin_converted_as_told_stays_headless_through_export(tmp_path, capsys):
    """The fix for a .bin folder said AutoModelForMaskedLM...save_pretrained: for a checkpoint without an MLM head
    that saves a random one, which then imported as trained. The untrained head of an import was also exported as a
    trained one, and its re-import said nothing."""
    import torch
    import transformers
    cfg = transformers.BertConfig(vocab_size=len(VOCAB), **F.TINY_BERT)
    torch.manual_seed(0)
    folder = tmp_path / "bin"
    transformers.BertModel(cfg).save_pretrained(str(folder), safe_serialization=False)
    F.write_vocab(folder, VOCAB)
    assert launch.main(["import-hf", f"--from={folder}", f"--workdir={tmp_path / 'refused'}"]) == 2
    err = capsys.readouterr().err
    command = re.search(r'`python -c "(.*)"` \(docs/interop.md\)', err).group(1).replace("DIR", str(folder))
    subprocess.run([sys.executable, "-c", command], check=True)
    run, again = tmp_path / "run", tmp_path / "again"
    assert launch.main(["import-hf", f"--from={folder}", f"--workdir={run}"]) == 0
    assert "note: the checkpoint has no MLM head" in capsys.readouterr().out
    from safetensors.numpy import load_file
    out = tmp_path / "export"
    assert launch.main(["export", f"--workdir={run}", f"--out={out}"]) == 0
    assert not [k for k in load_file(str(out / "model.safetensors")) if k.startswith("cls.")]
    assert json.loads((out / "config.json").read_text())["tupe_jax"]["fresh_mlm_head"] is True
    capsys.readouterr()
    assert launch.main(["import-hf", f"--from={out}", f"--workdir={again}"]) == 0
    assert "note: the checkpoint has no MLM head" in capsys.readouterr().out
