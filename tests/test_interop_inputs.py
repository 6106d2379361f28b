"""Hugging Face folders and exports that would import wrongly without a word, each refused in one line with
nothing written: a tensor in two shards (or where the index does not put it), integer weights, a tokenizer our
WordPiece does not reproduce, config values of the wrong type, more encoder layers than config.json says; and
export/analysis outputs inside a run's checkpoints/."""
import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[test]') brings transformers")

import launch  # noqa: E402
from tests import hf_fixtures as F  # noqa: E402
from tests.glue_fixtures import make_pretrained  # noqa: E402

VOCAB = F.BERT_SPECIALS + [f"w{i}" for i in range(60)]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tiny FlaxBertForMaskedLM saved by transformers (model.safetensors, config.json, vocab.txt)."""
    root = tmp_path_factory.mktemp("hf_inputs")
    F.save_hf_bert(root / "hf", VOCAB)
    return root / "hf"


def copy(hf, dst, config=None, tokenizer=None):
    """A copy of the folder `hf`, its config.json updated with `config`, and a tokenizer_config.json."""
    shutil.copytree(hf, dst)
    if config:
        path = dst / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tokenizer is not None:
        (dst / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    return dst


def refused(capsys, tmp_path, src, needle):
    """import-hf of `src` is one line naming `needle`, exit 2, and no run folder."""
    assert launch.main(["import-hf", f"--from={src}", f"--workdir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and needle in err and ", --from, " in err, err
    assert not (tmp_path / "run").exists()


def shard(hf, dst, parts, index=None):
    """`hf` with its weights split into shards: `parts` = [[tensor names], ...] (a name may repeat)."""
    from safetensors.numpy import load_file, save_file
    shutil.copytree(hf, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    os.remove(dst / "model.safetensors")
    for i, names in enumerate(parts):
        save_file({k: tensors[k] for k in names}, str(dst / f"part{i}.safetensors"), metadata={"format": "flax"})
    mapping = index or {k: f"part{i}.safetensors" for i, names in enumerate(parts) for k in names}
    (dst / "model.safetensors.index.json").write_text(mapping if isinstance(mapping, str)
                                                      else json.dumps({"weight_map": mapping}))
    return sorted(tensors)


def test_shards_that_disagree_with_their_index_or_each_other(hf, tmp_path, capsys):
    from safetensors.numpy import load_file
    names = sorted(load_file(str(hf / "model.safetensors")))
    first, rest = names[:1], names[1:]
    shard(hf, tmp_path / "twice", [first + rest[:2], rest],          # rest[:2] in both shards
          index={**{k: "part0.safetensors" for k in first + rest[:2]}, **{k: "part1.safetensors" for k in rest[2:]}})
    refused(capsys, tmp_path, tmp_path / "twice", f"tensor {rest[0]} is in both")
    shard(hf, tmp_path / "elsewhere", [first + rest[:1], rest[1:]],     # the index puts first[0] in part1
          index={first[0]: "part1.safetensors", rest[0]: "part0.safetensors",
                 **{k: "part1.safetensors" for k in rest[1:]}})
    refused(capsys, tmp_path, tmp_path / "elsewhere", f"tensor {first[0]} is in part0.safetensors but")
    listed = ", ".join(f'"{k}": "part1.safetensors"' for k in rest)
    shard(hf, tmp_path / "listed_twice", [first, rest],
          index='{"weight_map": {"%s": "part0.safetensors", %s, "%s": "part1.safetensors"}}' % (first[0], listed,
                                                                                              first[0]))
    refused(capsys, tmp_path, tmp_path / "listed_twice", "is listed twice")


def test_integer_weights_are_refused(hf, tmp_path, capsys):
    from safetensors.numpy import load_file, save_file
    src = copy(hf, tmp_path / "int")
    tensors = load_file(str(src / "model.safetensors"))
    name = sorted(tensors)[0]
    save_file({**tensors, name: tensors[name].astype(np.int64)}, str(src / "model.safetensors"),
              metadata={"format": "flax"})
    refused(capsys, tmp_path, src, f"tensor {name} in model.safetensors holds I64")


@pytest.mark.parametrize("tokenizer, needle", [
    ({"tokenize_chinese_chars": False}, "tokenize_chinese_chars=False"),
    ({"tokenizer_class": "BertJapaneseTokenizer", "word_tokenizer_type": "mecab"}, "BertJapaneseTokenizer"),
    ({"do_basic_tokenize": False}, "do_basic_tokenize=False"),
    ({"never_split": ["[FOO]"]}, "never_split=['[FOO]']")])
def test_a_tokenizer_our_wordpiece_does_not_reproduce_is_refused(hf, tmp_path, capsys, tokenizer, needle):
    refused(capsys, tmp_path, copy(hf, tmp_path / "tok", tokenizer=tokenizer), needle)


@pytest.mark.parametrize("name, text", [
    ("added_tokens.json", lambda n: {"zzfoo": n, "zzbar": n + 1}),
    ("tokenizer_config.json", lambda n: {"added_tokens_decoder": {str(n): {"content": "zzfoo", "special": False}}}),
    ("tokenizer.json", lambda n: {"added_tokens": [{"id": n, "content": "zzfoo"}]})])
def test_tokens_added_beyond_vocab_txt_are_refused(hf, tmp_path, capsys, name, text):
    """transformers keeps them whole; our WordPiece split them (other ids), and the import said nothing."""
    src = copy(hf, tmp_path / "added")
    (src / name).write_text(json.dumps(text(len(VOCAB))))
    refused(capsys, tmp_path, src, f"adds {1 + (name == 'added_tokens.json')} token(s) beyond vocab.txt ('zz")
    specials = {str(VOCAB.index(t)): {"content": t, "special": True} for t in ("[PAD]", "[UNK]", "[MASK]")}
    (src / name).unlink()   # the specials at their vocab.txt ids (what transformers writes for BERT) are fine,
    (src / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": specials}))
    (src / "vocab.txt").write_bytes(b"\xef\xbb\xbf" + (src / "vocab.txt").read_bytes())   # read as the tokenizer does
    assert launch.main(["import-hf", f"--from={src}", f"--workdir={tmp_path / 'run'}"]) == 0, capsys.readouterr()


def test_uncased_and_cased_bert_tokenizers_still_import(hf, tmp_path, capsys):
    for i, tokenizer in enumerate(({"tokenizer_class": "BertTokenizer", "do_lower_case": False},
                                   {"tokenizer_class": "BertTokenizerFast", "tokenize_chinese_chars": True})):
        src = copy(hf, tmp_path / f"ok{i}", tokenizer=tokenizer)
        assert launch.main(["import-hf", f"--from={src}", f"--workdir={tmp_path / f'run{i}'}"]) == 0, capsys.readouterr()


@pytest.mark.parametrize("config, needle", [
    ({"num_hidden_layers": 2.7}, "num_layers = 2.7, not an int"),
    ({"layer_norm_eps": "abc"}, "layer_norm_eps = 'abc', not a float"),
    ({"num_hidden_layers": 1}, "the weights hold 2 encoder layers (numbered 0 to 1) but config.json has "
                               "num_hidden_layers=1"),
    # 3000: it built a 3000-layer model first (a minute and a GB) and then named a missing layer.2 tensor
    ({"num_hidden_layers": 3000}, "the weights hold 2 encoder layers (numbered 0 to 1) but config.json has "
                                  "num_hidden_layers=3000")])
def test_config_values_of_the_wrong_type_or_the_wrong_layer_count_are_refused(hf, tmp_path, capsys, config, needle):
    refused(capsys, tmp_path, copy(hf, tmp_path / "cfg", config=config), needle)


def test_a_tensor_inside_a_layer_that_has_no_place_is_refused(hf, tmp_path, capsys):
    """A cross-attention tensor (a decoder's) in layer 0 was reported as 'the weights hold encoder layer 0 but
    num_hidden_layers=2'."""
    from safetensors.numpy import load_file, save_file
    src = copy(hf, tmp_path / "cross")
    tensors = load_file(str(src / "model.safetensors"))
    name = next(k for k in tensors if ".layer.0.attention.self.query." in k)     # Flax names in this file
    tensors[name.replace("attention.self", "crossattention.self")] = tensors[name]
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "flax"})
    refused(capsys, tmp_path, src, "encoder.layer.0.crossattention.self.query.bias of an encoder layer has no place")


def test_a_native_exports_model_section_is_read_strictly(tmp_path, capsys):
    make_pretrained(tmp_path / "pre", tmp_path / "cache", pe="rope")
    assert launch.main(["export", f"--workdir={tmp_path / 'pre'}", f"--out={tmp_path / 'export'}"]) == 0
    capsys.readouterr()
    path = tmp_path / "export" / "config.json"
    exported = json.loads(path.read_text())
    for edit, needle in (({"untie_cls": "false"}, "untie_cls = 'false', not a bool"),
                         ({"rope_scaling": 2.0}, "keys this version does not know: rope_scaling")):
        model = {**exported["tupe_jax"]["model"], **edit}
        path.write_text(json.dumps({**exported, "tupe_jax": {**exported["tupe_jax"], "model": model}}))
        refused(capsys, tmp_path, tmp_path / "export", needle)


def test_outputs_inside_a_runs_checkpoints_are_refused(tmp_path, capsys):
    """A folder named like a step in checkpoints/ is read as the newest step: every reader failed on it."""
    make_pretrained(tmp_path / "pre", tmp_path / "cache", pe="bert_a")
    before = sorted(os.listdir(tmp_path / "pre" / "checkpoints"))
    for argv in (["export", f"--workdir={tmp_path / 'pre'}", f"--out={tmp_path / 'pre' / 'checkpoints' / '11'}"],
                 ["probe", f"--workdir={tmp_path / 'pre'}", f"--out={tmp_path / 'pre' / 'checkpoints' / '12'}"]):
        assert launch.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "is inside the checkpoints of" in err and ", --out, " in err and "\n" not in err, err
    assert sorted(os.listdir(tmp_path / "pre" / "checkpoints")) == before


def test_part_of_an_mlm_head_is_refused(hf, tmp_path, capsys):
    """Without its dense kernel, the head's LayerNorm that the checkpoint did hold was dropped and the whole head
    initialised fresh, with exit status 0."""
    from safetensors.numpy import load_file, save_file
    src = copy(hf, tmp_path / "part")
    tensors = load_file(str(src / "model.safetensors"))
    for name in [k for k in tensors if k.startswith("cls.predictions.transform.dense.")]:
        tensors.pop(name)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "flax"})
    refused(capsys, tmp_path, src, "the checkpoint holds part of an MLM head (cls.predictions.transform.LayerNorm")
