"""`import-fairseq`: the TUPE authors' fairseq checkpoint (github.com/guolinke/TUPE) -> a `tupe_r` / `tupe_a` run.

`--from` is the extracted checkpoint folder (one `*.pt`, `dict.txt`, the BPE codes `bpe-code`) or the `.pt` file
itself (dict.txt and the codes next to it). The result is what `launch pretrain` leaves at step 0 (`hf.write_run`):
config.json, tokenizer/ (the official tokenizer path: `data/fairseq_bpe.py`) and checkpoints/0/.

Safe loading: the `.pt` is a PyTorch pickle, so it is read only with `torch.load(weights_only=True)` (PyTorch's
restricted unpickler: tensors and plain containers) plus an explicit allowlist: `argparse.Namespace` (the stored
args) and fairseq's training meters (`fairseq.meters.AverageMeter`, `TimeMeter`, `StopwatchMeter`, kept in
`extra_state['train_meters']`), which are mapped by name onto an inert local class that only stores the pickled
fields: no fairseq code exists here or runs. Any other global is refused in one line before it is called.

The config comes from the stored args, with the defaults the TUPE code fills in (`base_architecture`) for an arg the
checkpoint lacks: layers, width, heads, FFN width, max_positions (else tokens_per_sample), dropout rates, rel_pos
(tupe_r, else tupe_a). The TUPE code always unties positions and the [CLS] (so `untie_cls` is on), uses 32 relative
buckets to distance 128, LayerNorm eps 1e-5 and exact GELU. Refused, naming the arg: another architecture or
activation, pre-LN (`encoder_normalize_before`), no embedding LayerNorm (`embedding_normalize` off), an activation
dropout, another bucket layout, a learned absolute position table added to the input (upstream fairseq's
`embed_positions`: not the TUPE code's model), an output layer not tied to the embedding.
"""
from __future__ import annotations

import argparse
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from tupe_jax.config import unflatten
from tupe_jax.data.fairseq_bpe import FairseqBpeTokenizer, read_dictionary
from tupe_jax.errors import UserError, require
from tupe_jax.interop import fairseq_names, hf
from tupe_jax.interop.safetensors_io import require_finite
from tupe_jax.model import ModelConfig

WHERE = "--from"
CODES_NAMES = ("bpe-code", "bpe-codes", "bpe_code", "bpe_codes", "bpe.codes", "bpecodes", "codes", "codes.txt")
ARCHS = ("bert", "bert_base", "bert_large")
# What the TUPE code's `base_architecture` fills in for an arg the checkpoint does not store.
DEFAULTS = {"encoder_layers": 12, "encoder_embed_dim": 768, "encoder_ffn_embed_dim": 3072,
            "encoder_attention_heads": 12, "activation_fn": "gelu", "dropout": 0.1, "attention_dropout": 0.1,
            "activation_dropout": 0.0, "encoder_normalize_before": False, "embedding_normalize": False,
            "rel_pos": False, "pooler_activation_fn": "tanh"}
LARGE = {"encoder_layers": 24, "encoder_embed_dim": 1024, "encoder_ffn_embed_dim": 4096, "encoder_attention_heads": 16}
ARG_KEYS = {"encoder_layers": "num_layers", "encoder_embed_dim": "hidden_size", "encoder_attention_heads": "num_heads",
            "encoder_ffn_embed_dim": "mlp_dim", "dropout": "dropout_rate",
            "attention_dropout": "attention_dropout_rate"}
# (arg, value the TUPE code's model needs, what to say when it differs)
REQUIRED = (("activation_fn", ("gelu",), "only exact (erf) GELU models are supported"),
            ("encoder_normalize_before", (False,), "pre-LN blocks are not supported (the TUPE code's default is "
                                                   "post-LN)"),
            ("embedding_normalize", (True,), "this project's encoder always has the embedding LayerNorm "
                                             "(the TUPE recipe's --embedding-normalize)"),
            ("activation_dropout", (0.0, 0), "a dropout after the FFN activation is not supported"),
            ("rel_pos_bins", (32, None), "only 32 relative buckets are supported"),
            ("max_rel_pos", (128, None), "only a maximum relative distance of 128 is supported"))


# ------------------------------------------------------------------------------------------------ safe loading
class _Meter:
    """Inert stand-in for fairseq's meters: keeps the pickled fields, runs nothing."""

    def __setstate__(self, state: Any) -> None:
        self.state = state


SAFE_GLOBALS = [argparse.Namespace] + [(_Meter, f"fairseq.meters.{n}")
                                        for n in ("AverageMeter", "TimeMeter", "StopwatchMeter")] + [
    # numpy scalars (a fine-tune's best metric, e.g. scipy's pearsonr for STS-B, in extra_state): rebuilt from
    # their dtype and bytes, under numpy 2's name and numpy 1's
    np._core.multiarray.scalar, (np._core.multiarray.scalar, "numpy.core.multiarray.scalar"), np.dtype,
    *(getattr(np.dtypes, f"{k}DType") for k in ("Float16", "Float32", "Float64", "Int32", "Int64", "Bool"))]


def _torch():
    try:
        import torch
    except ImportError:
        raise UserError("import-fairseq needs PyTorch to read the .pt file, and it is not installed", WHERE,
                        "pip install -e .[fairseq]") from None
    return torch


def safe_load(path: str) -> dict:
    """The checkpoint dict, unpickled by PyTorch's weights-only unpickler with SAFE_GLOBALS allowed; anything else
    is a one-line UserError naming what was refused (nothing it names is imported or called)."""
    torch = _torch()
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:   # pylint: disable=broad-except  # torch raises UnpicklingError, RuntimeError, ...
        text = " ".join(str(err).split())
        found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"unrecognized function <?([^ ,>]+)", text) \
            or re.search(r"but got <class '([\w.]+)'>", text)
        if found:
            raise UserError(f"{path} holds {found.group(1)}, which is not on the allowlist of a safe load (tensors, "
                            "containers, argparse.Namespace, fairseq meters, numpy scalars); it was not run", WHERE,
                            "give the checkpoint as the TUPE code saved it, or re-save its 'args' and 'model' with "
                            "torch.save where you trust the file") from None
        detail = re.search(r"WeightsUnpickler error: (.*?) Check the documentation", text)
        raise UserError(f"{path} is not a PyTorch checkpoint ({(detail.group(1) if detail else text)[:160]})", WHERE,
                        "give the .pt file of the released checkpoint") from None
    require(isinstance(obj, dict) and "model" in obj, f"{path} is not a fairseq checkpoint (no 'model' entry)",
            WHERE, "give the .pt file that fairseq's train.py saved")
    return obj


# ------------------------------------------------------------------------------------------------ files
def find_files(src: str) -> tuple[str, str, str]:
    """(checkpoint .pt, dict.txt, BPE codes) of `--from` (a folder or the .pt itself)."""
    src = os.path.abspath(os.path.expanduser(src))
    require(os.path.exists(src), f"{src} does not exist", WHERE, "give the extracted checkpoint folder")
    if os.path.isdir(src):
        pts = sorted(n for n in os.listdir(src) if n.endswith(".pt"))
        require(bool(pts), f"{src} holds no .pt checkpoint", WHERE, "give the folder extracted from tupe_ckp.tar.gz")
        require(len(pts) == 1, f"{src} holds several checkpoints ({', '.join(pts[:4])})", WHERE,
                f"name one: --from={os.path.join(src, pts[0])}")
        folder, pt = src, os.path.join(src, pts[0])
    else:
        require(not src.endswith((".tar", ".tar.gz", ".tgz", ".zip")), f"{src} is an archive", WHERE,
                f"extract it first (tar xzf {os.path.basename(src)}) and give the folder")
        folder, pt = os.path.dirname(src), src
    dict_path = os.path.join(folder, "dict.txt")
    require(os.path.isfile(dict_path), f"{folder} has no dict.txt", WHERE, "put the released dict.txt next to the .pt")
    codes = next((os.path.join(folder, n) for n in CODES_NAMES if os.path.isfile(os.path.join(folder, n))), None)
    require(codes is not None, f"{folder} has no BPE codes ({' or '.join(CODES_NAMES[:2])})", WHERE,
            "put the released fastBPE codes file next to the .pt")
    return pt, dict_path, codes


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8", WHERE, "give the file as released") from None


# ------------------------------------------------------------------------------------------------ config
def model_keys(args: Any, where: str = WHERE, has_embedding_ln: bool | None = None) -> dict[str, Any]:
    """config.model keys from the stored args (refuses what this project cannot represent, naming the arg);
    `has_embedding_ln` (the weights hold emb_layer_norm) stands in for an `embedding_normalize` the args lack."""
    require(isinstance(args, argparse.Namespace), "the checkpoint stores no argparse args ('args' entry; newer "
            "fairseq's 'cfg' is not read)", where, "give a checkpoint saved by the TUPE code")
    a = dict(vars(args))
    if "embedding_normalize" not in a and has_embedding_ln is not None:
        a["embedding_normalize"] = has_embedding_ln
    arch = a.get("arch", "bert")
    require(arch in ARCHS, f"the checkpoint's args have arch={arch!r}", where,
            f"import-fairseq reads the TUPE code's BertModel ({'|'.join(ARCHS)})")
    a = {**DEFAULTS, **(LARGE if arch == "bert_large" else {}), **a}
    for key, ok, fix in REQUIRED:
        require(a.get(key) in ok, f"the checkpoint's args have {key}={a.get(key)!r}", where, fix)
    max_len = a.get("max_positions") or a.get("tokens_per_sample")
    require(isinstance(max_len, int) and max_len > 0, "the checkpoint's args have neither max_positions nor "
            "tokens_per_sample", where, "give a checkpoint saved by the TUPE code")
    keys = {ours: a[theirs] for theirs, ours in ARG_KEYS.items()}
    return {**keys, "max_len": max_len, "pe": "tupe_r" if a["rel_pos"] else "tupe_a", "objective": "mlm",
            "untie_cls": True, "layer_norm_eps": 1e-5, "rel_num_buckets": 32, "rel_max_distance": 128}


def _prefix(tensors: dict) -> str:
    for prefix in ("decoder.", "encoder.", ""):
        if f"{prefix}{fairseq_names.ENCODER}embed_tokens.weight" in tensors:
            return prefix
    raise UserError("the checkpoint's model holds no sentence_encoder.embed_tokens.weight", WHERE,
                    "give a checkpoint of the TUPE code's BertModel")


def check_architecture(tensors: dict, prefix: str) -> None:
    """Refuse weights of a model the stored args do not describe or this project cannot represent."""
    s = f"{prefix}{fairseq_names.ENCODER}"
    learned = f"{s}embed_positions.weight"
    require(learned not in tensors, f"the checkpoint has {learned} (positions added to the input): upstream "
            "fairseq's BERT/RoBERTa, not the TUPE code's untied model", WHERE,
            "import-fairseq reads TUPE-A/TUPE-R checkpoints of github.com/guolinke/TUPE")
    segment = f"{s}segment_embeddings.weight"
    require(segment not in tensors, f"the checkpoint has {segment}: segment embeddings are not supported", WHERE,
            "give a checkpoint trained without segments (the TUPE code has none)")
    out = tensors.get(f"{prefix}lm_head.weight")
    if out is not None:
        require(np.array_equal(np.asarray(out), np.asarray(tensors[f"{s}embed_tokens.weight"])),
                f"{prefix}lm_head.weight differs from the token embedding", WHERE,
                "only models whose output layer is tied to the embedding are supported")


def convert(src: str, base: ml_collections.ConfigDict, where: str = WHERE):
    """(config, params of jnp float32, tokenizer, notes) of the checkpoint at `src`; nothing is written."""
    pt, dict_path, codes_path = find_files(src)
    vocab = read_dictionary(_read(dict_path), dict_path)
    tokenizer = FairseqBpeTokenizer(vocab, _read(codes_path), source=codes_path)
    ckpt = safe_load(pt)
    torch = _torch()
    tensors = {k: v.detach().to(torch.float32).numpy() for k, v in ckpt["model"].items() if torch.is_tensor(v)}
    for name in sorted(tensors):     # an fp16 run that overflowed saves infs; NaN would pass every check below
        require_finite(name, tensors[name], pt, WHERE,
                       "give a checkpoint of finite weights (an earlier one of the run, if this one overflowed)")
    prefix = _prefix(tensors)
    keys = model_keys(ckpt.get("args"), where, f"{prefix}{fairseq_names.ENCODER}emb_layer_norm.weight" in tensors)
    check_architecture(tensors, prefix)
    rows = int(tensors[f"{prefix}{fairseq_names.ENCODER}embed_tokens.weight"].shape[0])
    require(rows == len(vocab), f"the token embedding has {rows} rows but dict.txt gives {len(vocab)} symbols "
            f"({len(vocab) - 8} lines + 7 specials + <mask>)", WHERE,
            "use the dict.txt the checkpoint was trained with")
    config = hf.build_config(base, {**keys, "vocab_size": rows}, where)
    cfg = ModelConfig.from_config(config.model)
    table_rows = fairseq_names.fairseq_rows(cfg.num_layers, cfg.pe == "tupe_r", prefix)
    flat, unused = fairseq_names.params_from_fairseq(tensors, hf.names.shapes(hf.abstract_params(cfg)), table_rows,
                                                     where)
    require(not unused, f"the checkpoint has tensors this model has no place for: {', '.join(unused[:4])}", WHERE,
            "give a checkpoint of the TUPE code's BertModel whose args match its weights")
    notes = []
    heads = sorted({k.split(".")[1] for k in tensors if k.startswith("classification_heads.")})
    if heads:
        notes.append(f"ignored the fine-tuning head(s) {', '.join(heads)} (fine-tuning starts a fresh one)")
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), unflatten(flat))
    return config, params, tokenizer, notes


def import_fairseq(src: str, workdir: str, base: ml_collections.ConfigDict) -> str:
    """Convert the checkpoint at `src` into a new run folder `workdir` (see the module docstring); returns it."""
    return hf.import_into(src, workdir, base, convert)
