"""`import-hf`: a Hugging Face BERT folder (config.json, model.safetensors, vocab.txt) -> a `bert_a` MLM run.

The run is what `launch pretrain` would leave at step 0: `config.json` (the base pretraining config with the
model keys from the checkpoint), `tokenizer/vocab.txt` (+ `tokenizer_config.json` when the casing is not BERT
uncased's) and `checkpoints/0/` (params, a fresh optimizer state, meta), so evaluate, finetune --init_from,
extrapolate, probe and correlations take it. This project's own exports (`export.py`, model_type 'tupe_jax') are
read back the same way, any scheme. Every check runs before anything is written; the name map is `names.py`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import ml_collections

from tupe_jax import checkpoint as ckpt_lib
from tupe_jax import files
from tupe_jax.config import unflatten
from tupe_jax import model as model_lib
from tupe_jax import optim
from tupe_jax import workdir as workdir_lib
from tupe_jax.workdir import provenance
from tupe_jax.data.tokenizer import Tokenizer
from tupe_jax.errors import UserError, require
from tupe_jax.interop import names, safetensors_io
from tupe_jax.interop.hf_tokenizer import read_tokenizer
from tupe_jax.model import ModelConfig, SequenceClassifier, TransformerLM

WHERE = "--from"
FRESH_HEAD = "the checkpoint has no MLM head"   # a note the run keeps (its meta: `fresh_mlm_head`)
NATIVE = "tupe_jax"   # model_type of this project's exports of non-BERT schemes
# HF BertConfig key -> config.model key
BERT_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
             "num_attention_heads": "num_heads", "intermediate_size": "mlp_dim", "max_position_embeddings": "max_len",
             "layer_norm_eps": "layer_norm_eps", "hidden_dropout_prob": "dropout_rate",
             "attention_probs_dropout_prob": "attention_dropout_rate", "type_vocab_size": "type_vocab_size"}
# What BertConfig assumes for a key config.json leaves out (transformers' documented defaults).
BERT_DEFAULTS = {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                 "intermediate_size": 3072, "max_position_embeddings": 512, "layer_norm_eps": 1e-12,
                 "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
                 "position_embedding_type": "absolute", "type_vocab_size": 2, "is_decoder": False,
                 "tie_word_embeddings": True}
LAYER = re.compile(r"(?:bert\.)?encoder\.layer\.(\d+)\.")   # an encoder block's tensors, by layer number
# ------------------------------------------------------------------------------------------------ config.json
def read_hf_config(src: str, where: str = WHERE) -> dict:
    require(os.path.isdir(src), f"{src} is not a folder", where, "point it at a Hugging Face model folder")
    path = os.path.join(src, "config.json")
    require(os.path.isfile(path), f"{src} has no config.json", where, "point it at a Hugging Face model folder "
            "(config.json, model.safetensors, vocab.txt)")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({err})", where, "restore it from the model's source") from None
    require(isinstance(hf, dict), f"{path} holds a JSON {type(hf).__name__}, not an object", where,
            "restore it from the model's source")
    section = hf.get(NATIVE)
    require(section is None or (isinstance(section, dict) and isinstance(section.get("model", {}), dict)),
            f"{path}: its '{NATIVE}' section is not an object with a 'model' object", where,
            "restore it from `launch export`'s output, or remove the section from a BERT checkpoint's config.json")
    return hf


def bert_model_keys(hf: dict, where: str = WHERE) -> dict[str, Any]:
    """The config.model keys of a BERT config.json; refuses another architecture or a BERT variant this model
    does not compute (another activation, relative positions, a decoder, an untied output layer)."""
    kind, archs = hf.get("model_type", "?"), hf.get("architectures")
    arch = ", ".join(map(str, archs)) if isinstance(archs, list) and archs else repr(archs) if archs else "none given"
    require(kind == "bert", f"config.json describes a {kind!r} model (architectures: {arch}), not BERT", where,
            "import-hf reads BERT checkpoints (model_type 'bert') and this project's own exports")
    hf = {**BERT_DEFAULTS, **hf}
    for key, ok, fix in (("hidden_act", ("gelu",), "only exact (erf) GELU BERTs are supported"),
                         ("position_embedding_type", ("absolute",), "only absolute-position BERTs are supported "
                          "(null: transformers adds no positions)"),
                         ("is_decoder", (False, None), "only BERT encoders are supported"),
                         ("tie_word_embeddings", (True,), "only BERTs whose output layer is the embedding (null: "
                          "transformers unties it)")):
        require(hf.get(key) in ok, f"config.json has {key}={hf.get(key)!r}", where, fix)
    require(not isinstance(hf["type_vocab_size"], int) or hf["type_vocab_size"] >= 1, f"config.json has "
            f"type_vocab_size={hf['type_vocab_size']!r}: a BERT adds its token-type row 0 to every token, so it has "
            "at least one", where, "fix that value in config.json (BERT's is 2)")
    return {**{ours: hf[theirs] for theirs, ours in BERT_KEYS.items()}, "pe": "bert_a", "objective": "mlm"}


def _typed(key: str, value: Any, current: Any, where: str) -> Any:
    """`value` as the type of the base config's `current`: a bool stays a bool, an int an int (an integral float
    becomes one), a float takes an int; anything else is refused (a cast would truncate 2.7 layers to 2, or read
    "false" as True)."""
    if isinstance(current, bool):
        ok = isinstance(value, bool)
    elif isinstance(current, int):
        ok = isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    elif isinstance(current, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, type(current))
    require(ok, f"config.json gives {key} = {value!r}, not a{'n' if type(current).__name__[0] in 'aeiou' else ''} "
            f"{type(current).__name__}", where, "fix that value in config.json")
    return type(current)(value)


def build_config(base: ml_collections.ConfigDict, model_keys: dict[str, Any], where: str = WHERE,
                 strict: bool = False) -> ml_collections.ConfigDict:
    """`base` (a configs/pretrain.py config) with `model_keys` set (of the base's types: `_typed`) and validated.
    `strict`: a key the base does not have is refused (a native export's model section is this project's own)."""
    config = ml_collections.ConfigDict(base.to_dict())
    unknown = sorted(k for k in model_keys if k not in config.model)
    require(not (strict and unknown), f"config.json's model section has keys this version does not know: "
            f"{', '.join(unknown[:4])}", where, "import it with the version of tupe-jax that exported it")
    for key, value in model_keys.items():
        if key in config.model:
            current = config.model[key]
            config.model[key] = _typed(key, value, current, where) if isinstance(current, (bool, int, float, str)) \
                else value
    config.data.vocab_file = ""
    if config.model.objective == "clm":
        config.model.untie_cls = False
    try:
        model_lib.validate_config(config.model)
    except UserError as err:
        raise UserError(f"the checkpoint's config is not a model this project can build ({err.what})", where,
                        "check its config.json") from None
    config.lock()
    return config


# ------------------------------------------------------------------------------------------------ tokenizer
# ------------------------------------------------------------------------------------------------ weights
def abstract_params(cfg: ModelConfig, classifier_labels: int = 0) -> Any:
    """ShapeDtypeStructs of a TransformerLM's params (or a SequenceClassifier's with `classifier_labels`)."""
    module = SequenceClassifier(cfg, classifier_labels) if classifier_labels else TransformerLM(cfg)
    tokens = jnp.zeros((1, min(cfg.max_len, 8)), jnp.int32)
    return jax.eval_shape(lambda: nn.meta.unbox(module.init({"params": jax.random.PRNGKey(0)}, tokens)["params"]))


def bert_prefix(tensors: dict, where: str = WHERE) -> str:
    for prefix in ("bert.", ""):
        if f"{prefix}embeddings.word_embeddings.weight" in tensors:
            return prefix
    raise UserError("the safetensors hold no BERT word embeddings (bert.embeddings.word_embeddings.weight)", where,
                    "give a BERT checkpoint saved by transformers")


def check_vocab(tensors: dict, prefix: str, hf: dict, tokenizer: Tokenizer, where: str = WHERE) -> None:
    rows = int(tensors[f"{prefix}embeddings.word_embeddings.weight"].shape[0])
    size = int(hf.get("vocab_size", BERT_DEFAULTS["vocab_size"]))
    require(size == rows, f"config.json has vocab_size={size} but the word embedding matrix has {rows} rows", where,
            "fix vocab_size in config.json to match the weights")
    require(tokenizer.vocab_size <= rows, f"vocab.txt has {tokenizer.vocab_size} tokens but the word embedding matrix "
            f"has {rows} rows", where, "use the vocab.txt the checkpoint was trained with")


def bert_params(tensors: dict, hf: dict, cfg: ModelConfig, tokenizer: Tokenizer, where: str = WHERE,
                classifier_labels: int = 0) -> tuple[dict, list[str]]:
    """(our params as {dotted path: array}, notes) from BERT `tensors`; the MLM head is initialised fresh (with a
    note) when the checkpoint has none (BertModel)."""
    prefix = bert_prefix(tensors, where)
    check_vocab(tensors, prefix, hf, tokenizer, where)
    layers = sorted({int(m.group(1)) for m in map(LAYER.match, tensors) if m})   # before building anything of N
    require(layers == list(range(len(layers))) and len(layers) == cfg.num_layers,   # no range(num_layers): 1e12
            f"the weights hold {len(layers)} encoder layers (numbered {layers[0] if layers else '-'} to "
            f"{layers[-1] if layers else '-'}) but config.json has num_hidden_layers={cfg.num_layers}", where,
            "fix num_hidden_layers in config.json")
    has_head = "cls.predictions.transform.dense.weight" in tensors
    part = sorted(k for k in tensors if k.startswith("cls.predictions.transform."))
    require(has_head or not part, f"the checkpoint holds part of an MLM head ({', '.join(part[:3])}) without "
            "cls.predictions.transform.dense.weight", where, "use a complete checkpoint, or one without the head")
    rows = names.bert_rows(cfg.num_layers, prefix, head=has_head and not classifier_labels,
                           classifier=bool(classifier_labels), token_types=cfg.type_vocab_size > 0)
    want = names.shapes(abstract_params(cfg, classifier_labels))
    flat, unused = names.params_from_bert(tensors, want, rows, where)
    inside = [name for name in unused if LAYER.match(name)]    # a layer's tensor this model has no place for
    require(not inside, f"tensor {inside[0] if inside else ''} of an encoder layer has no place in this model "
            f"({len(inside)} such)", where, "only plain BERT encoder layers are supported (no cross-attention)")
    notes = [f"ignored {len(unused)} tensor(s) this model has no place for: {', '.join(unused[:4])}"] if unused else []
    if set(flat) != set(want):
        fresh = names.flatten(model_lib.init_params(cfg, jax.random.PRNGKey(0)))
        missing = sorted(set(want) - set(flat))
        flat.update({k: fresh[k] for k in missing})
        notes.append(f"{FRESH_HEAD} ({', '.join(sorted({m.split('.')[0] for m in missing}))} "
                     "initialised fresh): fine for fine-tuning, MLM scores are meaningless until trained")
    return flat, notes


def native_params(tensors: dict, cfg: ModelConfig, where: str = WHERE) -> dict:
    """Our params from a native export: the keys must be exactly this model's param paths and shapes."""
    want = names.shapes(abstract_params(cfg))
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    require(not missing and not extra, f"the safetensors do not match the config's {cfg.pe} model (missing: "
            f"{missing[:3]}, unexpected: {extra[:3]})", where, "export the run again with `launch export`")
    for key, shape in want.items():
        got = tuple(tensors[key].shape)
        require(got == shape, f"tensor {key} has shape {list(got)}, the config.json asks for {list(shape)}", where,
                "export the run again with `launch export`")
    return tensors


def _trained_token_types(tensors: dict) -> bool:
    """Whether the checkpoint's token-type table holds anything but zeros (an export of a model without segment
    embeddings writes a zero table, its segment-0 row being folded into the positions)."""
    key = next((k for k in tensors if k.endswith(names.TOKEN_TYPE)), None)
    return key is not None and bool(np.any(np.asarray(tensors[key]) != 0))


# ------------------------------------------------------------------------------------------------ the run
def convert(src: str, base: ml_collections.ConfigDict, where: str = WHERE, classifier_labels: int = 0):
    """(config, params tree of jnp float32, tokenizer, notes) of the HF folder `src`; nothing is written.

    With `classifier_labels` the params are a `SequenceClassifier`'s: the checkpoint's pooler and classifier
    (`BertForSequenceClassification` with that many labels) on its encoder.
    """
    src = os.path.abspath(os.path.expanduser(src))
    hf = read_hf_config(src, where)
    native = hf.get("model_type") == NATIVE
    if native:
        keys = dict((hf.get(NATIVE) or {}).get("model") or {})
        require(bool(keys), "config.json of a tupe_jax export lacks its 'tupe_jax.model' section", where,
                "export the run again with `launch export`")
    ours = (hf.get(NATIVE) or {}).get("model", {})
    keys = keys if native else {**ours, **bert_model_keys(hf, where)}
    config = build_config(base, keys, where, strict=native)   # the config and tokenizer before the weights are read
    tokenizer = read_tokenizer(src, where)
    require(not (native and classifier_labels), "a tupe_jax export holds no classifier", where,
            "give a BertForSequenceClassification folder")
    tensors, _ = safetensors_io.read(src, where)
    trained_segments = []
    # this project's bert_a export: 0 stays 0 (export wrote a zero table), unless the table was trained since (a
    # sentence-pair fine-tune in transformers): then it is imported whole, as the checkpoint's own
    if not native and "type_vocab_size" in ours and not _trained_token_types(tensors):
        config = build_config(base, {**keys, "type_vocab_size": ours["type_vocab_size"]}, where)
    elif not native and "type_vocab_size" in ours and ours["type_vocab_size"] != keys.get("type_vocab_size"):
        trained_segments = [f"the token-type table was trained since this run's export: imported whole "
                            f"(model.type_vocab_size {keys.get('type_vocab_size')}, not the export's "
                            f"{ours['type_vocab_size']})"]
    cfg = ModelConfig.from_config(config.model)
    if native:
        flat, notes = native_params(tensors, cfg, where), []
    else:
        flat, notes = bert_params(tensors, hf, cfg, tokenizer, where, classifier_labels)
        notes = trained_segments + notes
    if (hf.get(NATIVE) or {}).get("fresh_mlm_head") and not any(n.startswith(FRESH_HEAD) for n in notes):
        notes.append(f"{FRESH_HEAD} trained (the exported run's was initialised at its import): MLM scores are "
                     "meaningless until trained")
    require(tokenizer.vocab_size <= cfg.vocab_size, f"vocab.txt has {tokenizer.vocab_size} tokens but the model "
            f"has {cfg.vocab_size} embedding rows", where, "use the vocab.txt the checkpoint was trained with")
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), unflatten(flat))
    return config, params, tokenizer, notes


def import_hf(src: str, workdir: str, base: ml_collections.ConfigDict) -> str:
    """Convert the HF folder `src` into a new run folder `workdir` (see the module docstring); returns it."""
    return import_into(src, workdir, base, convert)


def import_into(src: str, workdir: str, base: ml_collections.ConfigDict, convert_fn: Any) -> str:
    """The import commands' shared tail: refuse a non-empty `workdir` before reading anything, run
    `convert_fn(src, base) -> (config, params, tokenizer, notes)`, write the run at step 0 under a hidden name beside
    `workdir` and rename it into place when whole (`workdir_lib.staging_folder`: a failure or a kill leaves no half
    run), print the notes and a one-line summary; returns the absolute workdir."""
    for flag, path in (("--workdir", workdir), ("--from", src)):
        require(not files.is_remote(path), f"{path} is a bucket path; the imports read and write local folders",
                flag, "import into a local folder (then `gcloud storage cp -r` it to the bucket if a pod needs it)"
                if flag == "--workdir" else "download the folder first (`gcloud storage cp -r`)")
    workdir = os.path.abspath(os.path.expanduser(workdir))
    workdir_lib.refuse_in_checkpoints(workdir, [], "--workdir")
    require(not os.path.islink(workdir), f"{workdir} is a link", "--workdir", "give a new folder for the imported run")
    require(not os.path.ismount(workdir), f"{workdir} is a mount point", "--workdir",
            "give a new folder inside it (an import is renamed into place when whole)")
    require(not os.path.exists(workdir) or os.path.isdir(workdir), f"{workdir} is a file", "--workdir",
            "give a new folder for the imported run")
    require(not (os.path.exists(workdir) and os.listdir(workdir)), f"{workdir} already exists and is not empty",
            "--workdir", "give a new folder for the imported run")
    config, params, tokenizer, notes = convert_fn(src, base)
    staging = workdir_lib.staging_folder(workdir, "import")   # written whole, then renamed: a kill leaves no half run
    try:
        write_run(staging, config, params, tokenizer, fresh_head=any(n.startswith(FRESH_HEAD) for n in notes))
        if os.path.isdir(workdir):
            os.rmdir(workdir)                                 # the empty folder given
        os.rename(staging, workdir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    provenance.record(workdir)   # as every command that makes a run folder
    for note in notes:
        print(f"note: {note}", flush=True)
    cfg = ModelConfig.from_config(config.model)
    print(f"imported {src} -> {workdir} (pe={cfg.pe}, {cfg.num_layers} layers, d={cfg.hidden_size}, "
          f"{cfg.num_heads} heads, max_len {cfg.max_len}, vocab {tokenizer.vocab_size}, "
          f"{model_lib.count_params(params):,} parameters, step 0)", flush=True)
    return workdir


def write_run(workdir: str, config: ml_collections.ConfigDict, params: Any, tokenizer: Tokenizer,
              step: int = 0, fresh_head: bool = False) -> None:
    """config.json, tokenizer/ and checkpoints/<step>/ (params, a fresh optimizer state, meta) in `workdir`;
    `fresh_head`: the MLM head was initialised here (meta `fresh_mlm_head`: every command that loads the run says
    so)."""
    os.makedirs(workdir, exist_ok=True)
    workdir_lib.write_config(workdir, config)
    tokenizer.save(os.path.dirname(workdir_lib.tokenizer_path(workdir)))
    tx, _ = optim.make_optimizer(config.train)
    state = {"step": jnp.int32(step), "params": params, "opt_state": tx.init(params),
             "rng": jax.random.PRNGKey(int(config.train.seed))}
    with ckpt_lib.Checkpointer(workdir, async_=False) as checkpointer:
        checkpointer.save(step, state, data_state={}, force=True,
                          meta={**workdir_lib.make_meta(config, params, tokenizer.fingerprint),
                                **({"fresh_mlm_head": True} if fresh_head else {})})
