"""`export`: a run -> a folder for `transformers` (bert_a MLM) or this project's native safetensors layout.

- `bert_a` MLM encoders: the `BertForMaskedLM` layout (`config.json`, `model.safetensors` with PyTorch names and
  layouts, metadata format 'pt', `vocab.txt`, `tokenizer_config.json`, `special_tokens_map.json`), which
  `BertForMaskedLM` / `FlaxBertForMaskedLM.from_pretrained(DIR)` load unchanged.
- every other scheme (and causal decoders): `model.safetensors` keyed by our param paths (`names.py`, native map),
  a `config.json` with model_type 'tupe_jax' holding the run's `model` section, the same tokenizer files and a
  README.md; `launch import-hf --from=DIR` reads it back (docs/interop.md).
The folder is written under a temporary name and renamed when complete; an existing target is refused. `--out` may
be a bucket folder (`gs://...`): the export is made in a local temporary folder and uploaded, config.json last (a
folder without it is no model to `from_pretrained`), and what was uploaded is removed if the upload fails.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import jax
import numpy as np

from tupe_jax import files, local_staging
from tupe_jax import workdir as workdir_lib
from tupe_jax.data.tokenizer import CONFIG_NAME, SPECIALS
from tupe_jax.errors import require
from tupe_jax.interop import names, safetensors_io
from tupe_jax.interop.hf import NATIVE
from tupe_jax.interop.hf_tokenizer import SPECIAL_KEYS

README = """# A tupe_jax export ({pe}, {objective})

There is no `transformers` class for this positional scheme. `model.safetensors` is keyed by the model's Flax
parameter paths (`encoder.blocks_0.attention.qkv.kernel`, ...), arrays exactly as in `tupe_jax.model`; the
`tupe_jax.model` section of `config.json` is the model config. Load it into a run of this project with

    python -m launch import-hf --from=DIR --workdir=runs/{name}     # DIR: this folder, wherever it is now

(see docs/interop.md in tupe-jax for the name map and for loading it in plain JAX).
"""


def bert_config(model: dict, tokenizer: Any) -> dict:
    """A `BertConfig` for a bert_a MLM's `config.model` section (plus our section under 'tupe_jax')."""
    return {"architectures": ["BertForMaskedLM"], "model_type": "bert", "vocab_size": model["vocab_size"],
            "hidden_size": model["hidden_size"], "num_hidden_layers": model["num_layers"],
            "num_attention_heads": model["num_heads"], "intermediate_size": model["mlp_dim"],
            "hidden_act": "gelu", "hidden_dropout_prob": model["dropout_rate"],
            "attention_probs_dropout_prob": model["attention_dropout_rate"],
            "max_position_embeddings": model["max_len"],
            "type_vocab_size": model.get("type_vocab_size") or 2, "initializer_range": 0.02,
            "layer_norm_eps": model["layer_norm_eps"], "pad_token_id": tokenizer.pad_id,
            "position_embedding_type": "absolute", "tie_word_embeddings": True, "torch_dtype": "float32",
            NATIVE: {"model": model}}


def write_tokenizer(out: str, tokenizer: Any, max_len: int) -> None:
    """vocab.txt, tokenizer_config.json (BertTokenizer, the casing) and special_tokens_map.json; a tokenizer of
    another kind (an import-fairseq run's BPE: its tokenizer_config.json names it) is saved as it saves itself,
    which `import-hf` reads back (labelled BertTokenizer, its vocabulary would be read as WordPiece)."""
    tokenizer.save(out)   # vocab.txt (+ the casing when not the default; rewritten below with the HF keys)
    if tokenizer.casing_config().get("tokenizer_class"):
        return
    specials = dict(zip(SPECIAL_KEYS, SPECIALS))
    files.write_json(os.path.join(out, CONFIG_NAME), {
        **tokenizer.casing_config(), "tokenizer_class": "BertTokenizer", "model_max_length": max_len,
        "tokenize_chinese_chars": True, "clean_up_tokenization_spaces": False, **specials})
    files.write_json(os.path.join(out, "special_tokens_map.json"), specials)


def export(workdir: str, out: str, step: Optional[int] = None) -> str:
    """Export the run `workdir` (checkpoint `step`, default latest) to the new folder `out` (local or in a bucket);
    returns `out`. On several processes (a pod, where every host runs the command) all read the checkpoint and
    process 0 alone writes: two writers of one folder or bucket would race (a rename onto a folder another
    process made, uploads of the same objects, a failed upload removing another's)."""
    remote = files.is_remote(out)
    out = str(out).rstrip("/") if remote else os.path.abspath(os.path.expanduser(out))
    failure = None
    try:
        if files.is_remote(workdir):    # before any read: an unreachable store is a line, not minutes of retries
            workdir_lib.check_bucket(workdir, "--workdir")
        if remote:
            workdir_lib.check_bucket(out, "--out")
        workdir_lib.refuse_in_checkpoints(out, workdir, "--out")
        require(not (files.exists(out) or (not remote and os.path.islink(out))), f"{out} already exists", "--out",
                "give a new folder (export never overwrites)")
        if not remote:   # the nearest existing ancestor must be a writable folder (the rest is made as `mkdir -p`)
            ancestor = os.path.dirname(out)
            while not os.path.exists(ancestor):
                ancestor = os.path.dirname(ancestor)
            require(os.path.isdir(ancestor), f"{ancestor} is not a folder", "--out", "give a path inside a folder")
            require(os.access(ancestor, os.W_OK | os.X_OK), f"{ancestor} is not writable", "--out",
                    "give a path in a folder you can write")
    except Exception as err:  # pylint: disable=broad-except  # every process stops with it (`agree`)
        failure = err
    workdir_lib.agree(out, failure, "", stage="export checks")
    run = workdir_lib.load_run(workdir, step)
    if jax.process_index() != 0:
        print(f"process {jax.process_index()}: the export of {workdir} step {run.step} is written by process 0",
              flush=True)
        return out
    cfg = run.model_cfg
    is_bert = run.pe == "bert_a" and not cfg.causal
    name = out.rpartition("/")[2] if remote else os.path.basename(out)
    if remote:
        tmp = local_staging.make("export")
    else:   # the parent is made as `mkdir -p` would (exports/x in a fresh checkout)
        tmp = workdir_lib.staging_folder(out, "export")
    try:
        write_export(tmp, run, is_bert, name)
        if remote:
            upload(tmp, out)
        else:
            os.rename(tmp, out)
    finally:   # an unfinished export, or the local copy of a bucket export (after a rename: nothing)
        local_staging.remove(tmp)
    layout = "BertForMaskedLM" if is_bert else "tupe_jax native"
    print(f"exported {workdir} step {run.step} ({run.pe}, {cfg.objective}) -> {out} ({layout} layout)", flush=True)
    return out


def write_export(folder: str, run: Any, is_bert: bool, name: str) -> None:
    """The export's files in the local `folder` (module docstring); `name` is the export's folder name (the same
    bytes wherever the folder is written: its README names no path)."""
    cfg, model = run.model_cfg, run.config.model.to_dict()
    fresh = {"fresh_mlm_head": True} if run.fresh_mlm_head else {}   # an import's untrained head: said, not hidden
    if is_bert:   # without an untrained head: transformers then says it initialises one, as import-hf does
        tensors = names.bert_from_params(run.params, names.bert_rows(cfg.num_layers, head=not fresh,
                                                                      token_types=cfg.type_vocab_size > 0))
        hf_config = bert_config(model, run.tokenizer)
        hf_config[NATIVE].update(fresh)
        files.write_json(os.path.join(folder, "config.json"), hf_config)
        metadata = {"format": "pt"}   # PyTorch names and layouts: transformers loads it in torch or Flax
    else:
        tensors = names.flatten(run.params)
        arch = "TupeJaxForCausalLM" if cfg.causal else "TupeJaxForMaskedLM"
        files.write_json(os.path.join(folder, "config.json"), {
            "architectures": [arch], "model_type": NATIVE, "vocab_size": cfg.vocab_size,
            NATIVE: {"model": model, "step": run.step, "name_map": "param path joined with '.'", **fresh}})
        files.write_text(os.path.join(folder, "README.md"), README.format(pe=run.pe, objective=cfg.objective,
                                                                          name=name))
        metadata = {"format": NATIVE}   # one key: safetensors writes several in no fixed order (the scheme: config)
    safetensors_io.write(os.path.join(folder, safetensors_io.WEIGHTS), names_to_numpy(tensors), metadata)
    write_tokenizer(folder, run.tokenizer, cfg.max_len)


def upload(folder: str, out: str) -> None:
    """Every file of the local `folder` into the bucket folder `out`, config.json last; on a failure what was
    uploaded is removed (`out` did not exist before)."""
    try:
        for entry in sorted(os.listdir(folder), key=lambda n: (n == "config.json", n)):
            files.upload(os.path.join(folder, entry), files.join(out, entry))
    except BaseException:
        if files.exists(out):
            files.rmtree(out)
        raise


def names_to_numpy(tensors: dict) -> dict:
    return {k: np.asarray(v, np.float32) for k, v in tensors.items()}
