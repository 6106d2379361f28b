"""Hugging Face interop: import-hf and export against transformers' own BERT (Flax classes, float32, dropout
off), the round trips, and the one-line errors. The tokenizer comparison is tests/test_interop_tokenizer.py."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[test]') brings transformers")

import launch  # noqa: E402
from tests import hf_fixtures as F  # noqa: E402
from tests.glue_fixtures import load_config_module, make_pretrained  # noqa: E402
from tupe_jax import workdir as workdir_lib  # noqa: E402
from tupe_jax.finetune.init_from import MUST_MATCH  # noqa: E402
from tupe_jax.interop import hf as hf_lib  # noqa: E402
from tupe_jax.model import SequenceClassifier, TransformerLM  # noqa: E402
from tupe_jax.positional import SCHEMES  # noqa: E402

TOL = 1e-5
VOCAB = F.BERT_SPECIALS + [f"w{i}" for i in range(150)]


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def one_line_error(capsys, argv) -> str:
    assert launch.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def hf_mlm(tmp_path_factory):
    """A random tiny FlaxBertForMaskedLM saved by transformers, imported with `launch import-hf`."""
    root = tmp_path_factory.mktemp("hf_mlm")
    model, params, cfg = F.save_hf_bert(root / "hf", VOCAB)
    assert launch.main(["import-hf", f"--from={root / 'hf'}", f"--workdir={root / 'run'}"]) == 0
    return {"root": root, "model": model, "params": params, "cfg": cfg, "run": str(root / "run")}


def test_import_hf_equals_transformers_mlm_logits_and_hidden_states(hf_mlm):
    run = workdir_lib.load_run(hf_mlm["run"])
    assert run.pe == "bert_a" and run.step == 0 and run.model_cfg.layer_norm_eps == 1e-12
    assert (run.tokenizer.pad_id, run.tokenizer.unk_id, run.tokenizer.cls_id, run.tokenizer.sep_id,
            run.tokenizer.mask_id) == (0, 100, 101, 102, 103)
    ids, mask = F.padded_batch(len(VOCAB))
    theirs = hf_mlm["model"](ids, attention_mask=mask, params=hf_mlm["params"], train=False,
                             output_hidden_states=True)
    ours = TransformerLM(run.model_cfg).apply({"params": run.params}, jnp.asarray(ids), jnp.asarray(mask),
                                              return_hidden=True)
    logits = max_diff(theirs.logits, ours["logits"])
    hidden = max(max_diff(a, b) for a, b in zip(theirs.hidden_states, ours["hidden_states"]))
    print(f"\nimport-hf vs transformers: MLM logits max|diff| {logits:.2e}, hidden states {hidden:.2e}")
    assert len(theirs.hidden_states) == len(ours["hidden_states"]) == 3
    assert logits <= TOL and hidden <= TOL


def test_import_hf_classifier_head_equals_transformers(tmp_path):
    src = tmp_path / "cls"
    model, params, cfg = F.save_hf_bert(src, VOCAB, "FlaxBertForSequenceClassification", seed=3, num_labels=3)
    base = load_config_module("pretrain").get_config("pe=bert_a")
    config, ours_params, _, _ = hf_lib.convert(str(src), base, classifier_labels=3)
    ids, mask = F.padded_batch(len(VOCAB), seed=1)
    theirs = model(ids, attention_mask=mask, params=params, train=False).logits
    cfg_ours = hf_lib.ModelConfig.from_config(config.model)
    ours = SequenceClassifier(cfg_ours, 3).apply({"params": ours_params}, jnp.asarray(ids), jnp.asarray(mask))
    diff = max_diff(theirs, ours)
    print(f"\nBertForSequenceClassification (pooler + classifier) vs ours: logits max|diff| {diff:.2e}")
    assert diff <= TOL


def pair_segments(mask):
    """BERT token types of a padded batch read as sentence pairs: 1 from the middle of each row's real tokens on."""
    lengths = mask.sum(axis=1)
    return ((np.arange(mask.shape[1])[None, :] >= (lengths[:, None] + 1) // 2) & (mask > 0)).astype(np.int32)


def test_import_hf_keeps_bert_segment_embeddings(hf_mlm, tmp_path):
    """Sentence pairs (token_type_ids 1 on the second sentence): MLM logits equal transformers' (the segment table is
    imported whole, `model.type_vocab_size` 2), and so do a BertForSequenceClassification's logits."""
    run = workdir_lib.load_run(hf_mlm["run"])
    assert run.model_cfg.type_vocab_size == 2
    assert np.any(np.asarray(run.params["encoder"]["token_type"]["embedding"][1]) != 0)
    ids, mask = F.padded_batch(len(VOCAB), seed=5)
    types = pair_segments(mask)
    assert types.any() and not types[:, 0].any()
    theirs = hf_mlm["model"](ids, attention_mask=mask, token_type_ids=types, params=hf_mlm["params"], train=False)
    ours = TransformerLM(run.model_cfg).apply({"params": run.params}, jnp.asarray(ids), jnp.asarray(mask),
                                              segments=jnp.asarray(types))["logits"]
    without = TransformerLM(run.model_cfg).apply({"params": run.params}, jnp.asarray(ids), jnp.asarray(mask))
    assert max_diff(theirs.logits, ours) <= TOL and max_diff(theirs.logits, without["logits"]) > 1e-3
    model, params, _ = F.save_hf_bert(tmp_path / "cls", VOCAB, "FlaxBertForSequenceClassification", seed=6,
                                      num_labels=2)
    config, ours_params, _, _ = hf_lib.convert(str(tmp_path / "cls"), load_config_module("pretrain").get_config(
        "pe=bert_a"), classifier_labels=2)
    theirs = model(ids, attention_mask=mask, token_type_ids=types, params=params, train=False).logits
    ours = SequenceClassifier(hf_lib.ModelConfig.from_config(config.model), 2).apply(
        {"params": ours_params}, jnp.asarray(ids), jnp.asarray(mask), segments=jnp.asarray(types))
    diff = max_diff(theirs, ours)
    print(f"\nsentence pairs with token types: MLM logits and classifier logits within {TOL} (classifier {diff:.2e})")
    assert diff <= TOL


def test_import_of_a_bert_model_without_mlm_head_initialises_the_head(tmp_path, capsys):
    F.save_hf_bert(tmp_path / "bare", VOCAB, "FlaxBertModel", seed=4)
    assert launch.main(["import-hf", f"--from={tmp_path / 'bare'}", f"--workdir={tmp_path / 'run'}"]) == 0
    assert "no MLM head" in capsys.readouterr().out
    run = workdir_lib.load_run(str(tmp_path / "run"))      # and every later read says so (evaluate reported its loss)
    assert "its MLM head was initialised at import" in capsys.readouterr().out
    assert set(run.params) == {"encoder", "head_dense", "head_ln", "head_bias"}


@pytest.mark.slow
def test_trained_bert_a_exports_to_transformers_with_the_same_logits(tmp_path):
    """Pretrain a tiny bert_a here (a few steps), `launch export`, FlaxBertForMaskedLM.from_pretrained loads the
    PyTorch-format safetensors unchanged (no torch), and BertTokenizerFast reads the tokenizer files."""
    import transformers
    from tupe_jax import config as config_lib
    from tupe_jax.pretrain import loop as pretrain_loop
    config = load_config_module("pretrain").get_config("pe=bert_a")
    config_lib.apply_overrides(config, {
        "model.hidden_size": "32", "model.num_layers": "2", "model.num_heads": "4", "model.mlp_dim": "64",
        "model.vocab_size": "512", "model.max_len": "32", "train.steps": "4", "train.batch_size": "16",
        "train.learning_rate": "3e-3", "train.warmup_steps": "2", "train.log_every": "2", "train.eval_every": "0",
        "checkpoint.async_save": "false", "data.cache_dir": str(tmp_path / "cache")})
    pretrain_loop.pretrain(config, str(tmp_path / "run"), devices=jax.devices()[:1])
    assert launch.main(["export", f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'hf'}"]) == 0
    run = workdir_lib.load_run(str(tmp_path / "run"))
    model = transformers.FlaxBertForMaskedLM.from_pretrained(str(tmp_path / "hf"))
    ids, mask = F.padded_batch(run.tokenizer.vocab_size, seed=2)
    ids[:, 0] = run.tokenizer.cls_id
    theirs = model(ids, attention_mask=mask, train=False).logits
    ours = TransformerLM(run.model_cfg).apply({"params": run.params}, jnp.asarray(ids), jnp.asarray(mask))["logits"]
    diff = max_diff(theirs, ours)
    print(f"\ntrained bert_a -> export -> FlaxBertForMaskedLM: logits max|diff| {diff:.2e}")
    assert diff <= TOL
    hf_tok = transformers.BertTokenizerFast.from_pretrained(str(tmp_path / "hf"))
    text = "The quick brown fox, naïvely: jumps over 3 lazy dogs."
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == run.tokenizer.encode(text)


@pytest.mark.parametrize("pe,objective", [(pe, "mlm") for pe in SCHEMES] + [
    ("bert_a", "clm"), ("rope", "clm"), ("alibi", "clm"), ("nopos", "clm"), ("bert_a", "mlm+segments"),
    ("tupe_r", "mlm+segments")])
def test_export_then_import_hf_gives_bitwise_equal_params(pe, objective, tmp_path, cache):
    extra = {"objective": objective, "untie_cls": False} if objective == "clm" else {}
    if objective == "mlm+segments":
        objective, extra = "mlm", {"type_vocab_size": 2}
    params = make_pretrained(tmp_path / "run", cache, pe=pe, **extra)
    assert launch.main(["export", f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'out'}"]) == 0
    hf_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf_config["model_type"] == ("bert" if (pe, objective) == ("bert_a", "mlm") else "tupe_jax")
    assert launch.main(["import-hf", f"--from={tmp_path / 'out'}", f"--workdir={tmp_path / 'back'}"]) == 0
    back = workdir_lib.load_run(str(tmp_path / "back"))
    assert back.config.model.to_dict() == workdir_lib.read_config(str(tmp_path / "run")).model.to_dict()
    flat_a = dict(jax.tree_util.tree_leaves_with_path(params))
    flat_b = dict(jax.tree_util.tree_leaves_with_path(back.params))
    assert flat_a.keys() == flat_b.keys()
    for key, a in flat_a.items():
        b = flat_b[key]
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes(), key
    assert back.tokenizer.vocab == workdir_lib.load_run(str(tmp_path / "run")).tokenizer.vocab
    if hf_config["model_type"] == "tupe_jax":   # docs/interop.md's snippet, as written, loads it in plain JAX
        ids = jnp.arange(1, 9, dtype=jnp.int32)[None]
        scope = {"DIR": str(tmp_path / "out"), "token_ids": ids}
        exec(_plain_jax_snippet(), scope)  # pylint: disable=exec-used
        np.testing.assert_array_equal(scope["logits"], TransformerLM(scope["cfg"]).apply({"params": params},
                                                                                          ids)["logits"])
    elif extra.get("type_vocab_size"):   # transformers reads the exported segment table: pairs give our logits
        import transformers
        assert hf_config["type_vocab_size"] == 2
        model = transformers.FlaxBertForMaskedLM.from_pretrained(str(tmp_path / "out"))
        ids, mask = F.padded_batch(back.tokenizer.vocab_size, seed=3)
        types = pair_segments(mask)
        theirs = model(ids, attention_mask=mask, token_type_ids=types, train=False).logits
        ours = TransformerLM(back.model_cfg).apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask),
                                                   segments=jnp.asarray(types))["logits"]
        assert max_diff(theirs, ours) <= TOL


def _plain_jax_snippet() -> str:
    """The python block of docs/interop.md under "In plain JAX, without a run folder"."""
    doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "interop.md"),
               encoding="utf-8").read()
    after = doc.split("In plain JAX, without a run folder:", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def test_docs_print_the_name_map():
    from tupe_jax.interop.names import bert_rows
    doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "interop.md"),
               encoding="utf-8").read()
    for ours, part, theirs, layout in bert_rows(1):
        ours, theirs = ours.replace("blocks_0", "blocks_{i}"), theirs.replace("layer.0", "layer.{i}")
        index = "" if part is None else f"[:, {part}]" if layout == "qkv_kernel" else f"[{part}]"
        assert f"| `{ours}{index}` | `{theirs}` | {layout} |" in doc


# ------------------------------------------------------------------------------------------------ bad input
def test_a_folder_without_safetensors_is_one_line_and_writes_nothing(tmp_path, capsys):
    src = tmp_path / "pt"
    F.write_vocab(src, VOCAB)
    (src / "config.json").write_text(json.dumps({"model_type": "bert", **F.TINY_BERT, "vocab_size": len(VOCAB),
                                                 "hidden_act": "gelu"}))
    (src / "pytorch_model.bin").write_bytes(b"not read")
    err = one_line_error(capsys, ["import-hf", f"--from={src}", f"--workdir={tmp_path / 'run'}"])
    assert "only safetensors are read" in err and "pickle" in err
    os.remove(src / "pytorch_model.bin")
    err = one_line_error(capsys, ["import-hf", f"--from={src}", f"--workdir={tmp_path / 'run'}"])
    assert "has no model.safetensors" in err
    assert not (tmp_path / "run").exists()


def copy_with_config(hf_mlm, src, edit):
    """A copy of the saved HF model folder at `src` with `edit(config dict)` applied to its config.json."""
    src.mkdir()
    for name in os.listdir(hf_mlm["root"] / "hf"):
        (src / name).write_bytes((hf_mlm["root"] / "hf" / name).read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def test_another_architecture_is_one_line_and_writes_nothing(hf_mlm, tmp_path, capsys):
    src = copy_with_config(hf_mlm, tmp_path / "roberta", lambda cfg: cfg.update(
        model_type="roberta", architectures=["RobertaForMaskedLM"]))
    err = one_line_error(capsys, ["import-hf", f"--from={src}", f"--workdir={tmp_path / 'run'}"])
    assert "'roberta' model" in err and "RobertaForMaskedLM" in err and "not BERT" in err
    assert not (tmp_path / "run").exists()
    src = copy_with_config(hf_mlm, tmp_path / "no_types", lambda cfg: cfg.update(type_vocab_size=0))   # a traceback
    err = one_line_error(capsys, ["import-hf", f"--from={src}", f"--workdir={tmp_path / 'run'}"])
    assert "type_vocab_size=0" in err and not (tmp_path / "run").exists()


def test_vocab_size_disagreeing_with_the_embeddings_is_one_line(hf_mlm, tmp_path, capsys):
    cfg = json.loads((hf_mlm["root"] / "hf" / "config.json").read_text())        # the model's own config
    src = copy_with_config(hf_mlm, tmp_path / "bad_vocab", lambda c: c.update(vocab_size=cfg["vocab_size"] + 7))
    err = one_line_error(capsys, ["import-hf", f"--from={src}", f"--workdir={tmp_path / 'run'}"])
    assert f"vocab_size={cfg['vocab_size'] + 7}" in err and f"has {cfg['vocab_size']} rows" in err
    (src / "config.json").write_text(json.dumps(cfg))
    F.write_vocab(src, VOCAB + ["extra1", "extra2"])
    err = one_line_error(capsys, ["import-hf", f"--from={src}", f"--workdir={tmp_path / 'run'}"])
    assert f"vocab.txt has {len(VOCAB) + 2} tokens" in err
    assert not (tmp_path / "run").exists()


def test_export_to_an_existing_folder_and_import_into_a_used_workdir_are_refused(hf_mlm, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    err = one_line_error(capsys, ["export", f"--workdir={hf_mlm['run']}", f"--out={tmp_path / 'out'}"])
    assert "already exists" in err and "--out" in err
    assert os.listdir(tmp_path / "out") == []
    err = one_line_error(capsys, ["import-hf", f"--from={hf_mlm['root'] / 'hf'}", f"--workdir={hf_mlm['run']}"])
    assert "not empty" in err


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(F.SHARED_GLUE), reason=f"the GLUE TSVs are not at {F.SHARED_GLUE}")
def test_finetune_from_an_imported_bert_runs_end_to_end_on_rte(tmp_path, capsys):
    """A BERT made by transformers (vocab learned on RTE train text) -> import-hf -> `launch finetune` on RTE, with
    the command import-hf prints, which gives no model keys: the fine-tune takes the imported run's."""
    from tupe_jax.data import glue_tsv
    rows = list(glue_tsv.parse_tsv(os.path.join(F.SHARED_GLUE, "RTE", "train.tsv"), "rte", "train"))
    vocab = F.bert_layout_vocab([r["sentence1"] + " " + r["sentence2"] for r in rows], 1500)
    F.save_hf_bert(tmp_path / "hf", vocab, seed=7)
    assert launch.main(["import-hf", f"--from={tmp_path / 'hf'}", f"--workdir={tmp_path / 'bert'}"]) == 0
    hint = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("fine-tune it: "))
    printed = hint.split()[6:-2]          # after "fine-tune it: python -m launch finetune"; before OUT and GLUE
    assert printed == ["--config=configs/glue.py:task=TASK", f"--config.init_from={tmp_path / 'bert'}"]
    glue = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "glue.py")
    argv = ["finetune", printed[0].replace("configs/glue.py", glue).replace("TASK", "rte"),
            f"--workdir={tmp_path / 'rte'}", *printed[1:], f"--config.data.glue_dir={F.SHARED_GLUE}",
            f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.train.steps=6", "--config.train.batch_size=16",
            "--config.train.log_every=3", "--config.checkpoint.async_save=false", "--config.data.glue_buckets=(64,)"]
    assert launch.main(argv) == 0
    model = json.loads((tmp_path / "rte" / "config.json").read_text())["model"]
    imported = json.loads((tmp_path / "bert" / "config.json").read_text())["model"]
    assert {k: model[k] for k in MUST_MATCH} == {k: imported[k] for k in MUST_MATCH}
    assert model["layer_norm_eps"] == 1e-12 and model["type_vocab_size"] == 2 and model["vocab_size"] == len(vocab)
    results = json.loads((tmp_path / "rte" / "results.json").read_text())
    print(f"\nRTE from an imported BERT: {json.dumps(results)[:300]}")
    assert (tmp_path / "rte" / "tokenizer" / "vocab.txt").read_text().splitlines()[101] == "[CLS]"
    assert (tmp_path / "rte" / "predictions" / "RTE.tsv").is_file()


@pytest.mark.slow
def test_an_imported_run_is_taken_by_evaluate_and_the_analyses(tmp_path, capsys):
    """import-hf of a BERT whose vocabulary was learned on the embedded corpus; each command exits 0."""
    from tupe_jax.data import load_documents
    config = load_config_module("pretrain").get_config("pe=bert_a")
    with config.unlocked():
        config.data.cache_dir = str(tmp_path / "cache")
    vocab = F.bert_layout_vocab(load_documents(config, "train")[:400], 1500)
    F.save_hf_bert(tmp_path / "hf", vocab, seed=9)
    run = str(tmp_path / "run")
    assert launch.main(["import-hf", f"--from={tmp_path / 'hf'}", f"--workdir={run}"]) == 0
    with open(os.path.join(run, "config.json")) as f:
        stored = json.load(f)
    stored["data"]["cache_dir"] = str(tmp_path / "cache")   # as a user edits a run's data section
    with open(os.path.join(run, "config.json"), "w") as f:
        json.dump(stored, f)
    for argv in (["evaluate"], ["extrapolate", "--lengths=16,32"], ["probe", "--probe_steps=3"], ["correlations"]):
        assert launch.main(argv + [f"--workdir={run}"]) == 0, argv
    out = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + "\n".join(line for line in out.splitlines() if "step 0:" in line or "run (" in line))
    assert "eval_loss" in out and "16: nan" not in out and "MAD per layer" in out


def test_sharded_bfloat16_safetensors_import(tmp_path, cache):
    """A checkpoint split into shards listed by model.safetensors.index.json, stored in bfloat16 (as on the Hub)."""
    import safetensors.flax
    import safetensors.numpy
    params = make_pretrained(tmp_path / "run", cache, pe="bert_a")
    assert launch.main(["export", f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'out'}"]) == 0
    tensors = safetensors.numpy.load_file(str(tmp_path / "out" / "model.safetensors"))
    os.remove(tmp_path / "out" / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        safetensors.flax.save_file({k: jnp.asarray(tensors[k], jnp.bfloat16) for k in part},
                                   str(tmp_path / "out" / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in part})
    (tmp_path / "out" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert launch.main(["import-hf", f"--from={tmp_path / 'out'}", f"--workdir={tmp_path / 'back'}"]) == 0
    back = workdir_lib.load_run(str(tmp_path / "back"))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(back.params)):
        np.testing.assert_array_equal(np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32), b, err_msg=str(path))
