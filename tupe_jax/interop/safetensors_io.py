"""Reading and writing weights as safetensors (never pickles).

A Hugging Face folder holds `model.safetensors` or shards listed by `model.safetensors.index.json`. PyTorch-format
files (metadata format 'pt', the Hub's usual) keep PyTorch names and layouts; Flax-format files (format 'flax',
written by `FlaxPreTrainedModel.save_pretrained(safe_serialization=True)`) are renamed to the PyTorch spelling
here (`kernel` -> `weight` transposed, `scale`/`embedding` -> `weight`), so the name map has one spelling.
`pytorch_model.bin` (a pickle), `tf_model.h5` and `flax_model.msgpack` are refused.
"""
from __future__ import annotations

import json
import os
from typing import Mapping

import numpy as np

from tupe_jax.errors import UserError, require

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
OTHER_FORMATS = {"pytorch_model.bin": "a PyTorch pickle, which can run code when loaded",
                 "pytorch_model.bin.index.json": "sharded PyTorch pickles, which can run code when loaded",
                 "tf_model.h5": "TensorFlow weights", "flax_model.msgpack": "Flax msgpack weights"}
FIX = ("convert it once, where you trust the file, keeping its tensors as they are (not through a model class, which "
       "adds a random head a checkpoint lacks): `python -c \"import torch; from safetensors.torch import save_file; "
       "sd = torch.load('DIR/pytorch_model.bin', weights_only=True); save_file({k: v.contiguous().clone() for k, v in "
       "sd.items()}, 'DIR/model.safetensors', metadata={'format': 'pt'})\"` (docs/interop.md)")


FLOATS = ("F16", "BF16", "F32", "F64")   # safetensors dtype names read as weights (float32 copies)


def require_finite(name: str, array: np.ndarray, source: str, where: str, fix: str) -> None:
    """A one-line UserError if the weight `name` read from `source` holds NaN or inf (an import would evaluate as
    if trained, or NaN everywhere downstream)."""
    bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
    require(not bad, f"tensor {name} in {source} holds {bad} non-finite value(s) (NaN or inf)", where, fix)


def _no_repeats(pairs: list) -> dict:
    """A JSON object's pairs as a dict, refusing a key given twice (json would keep the last silently)."""
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ValueError(f"{twice[0]!r} is listed twice")
    return dict(pairs)


def weight_map(src: str, where: str) -> dict[str, str]:
    """{tensor name: shard file} of the folder's index ({} without one)."""
    path = os.path.join(src, INDEX)
    if os.path.isfile(os.path.join(src, WEIGHTS)) or not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            mapping = json.load(f, object_pairs_hook=_no_repeats)["weight_map"]
        if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
            raise ValueError("weight_map is not {tensor: file}")
    except (ValueError, KeyError, TypeError) as err:
        raise UserError(f"{path} is not a safetensors index ({err})", where,
                        "restore the file from the model's source") from None
    return mapping


def weight_files(src: str, where: str) -> list[str]:
    """The safetensors files of folder `src` (one, or the shards of its index); UserError if there are none."""
    if os.path.isfile(os.path.join(src, WEIGHTS)):
        return [os.path.join(src, WEIGHTS)]
    if os.path.isfile(os.path.join(src, INDEX)):
        shards = sorted(set(weight_map(src, where).values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(src, s))]
        if missing:
            raise UserError(f"{src} lacks the shard(s) {', '.join(missing)} listed in {INDEX}", where,
                            "download every shard")
        return [os.path.join(src, s) for s in shards]
    other = [f"{name} ({why})" for name, why in OTHER_FORMATS.items() if os.path.isfile(os.path.join(src, name))]
    if other:
        raise UserError(f"{src} has no {WEIGHTS}, only {', '.join(other)}; only safetensors are read", where, FIX)
    raise UserError(f"{src} has no {WEIGHTS}", where, "point it at a Hugging Face model folder (config.json, "
                    f"{WEIGHTS}, vocab.txt)")


def read(src: str, where: str) -> tuple[dict[str, np.ndarray], str]:
    """({name: float32 array}, format) of the safetensors in folder `src`; Flax names become PyTorch names."""
    from safetensors import SafetensorError, safe_open
    tensors: dict[str, np.ndarray] = {}
    found: dict[str, str] = {}      # tensor name -> the file it came from
    index = weight_map(src, where)
    fmt = ""
    for path in weight_files(src, where):
        shard = os.path.basename(path)
        try:
            # framework='flax' reads bfloat16 too (NumPy has no bfloat16); float32 copies on the host
            with safe_open(path, framework="flax") as f:
                fmt = (f.metadata() or {}).get("format", fmt or "pt")
                for name in f.keys():
                    require(name not in found, f"tensor {name} is in both {found.get(name)} and {shard}", where,
                            "give the model's own shards (each tensor in one file)")
                    require(not index or index.get(name) == shard, f"tensor {name} is in {shard} but {INDEX} "
                            f"puts it in {index.get(name)}", where, "restore the index from the model's source")
                    dtype = f.get_slice(name).get_dtype()
                    require(dtype in FLOATS, f"tensor {name} in {shard} holds {dtype}, not floating-point weights",
                            where, "give a checkpoint of float weights (float16, bfloat16, float32 or float64)")
                    tensors[name], found[name] = np.asarray(f.get_tensor(name), np.float32), shard
                    require_finite(name, tensors[name], shard, where,
                                   "download it again, or give a checkpoint of finite weights")
        except (SafetensorError, OSError) as err:
            raise UserError(f"{path} is not a readable safetensors file ({err})", where,
                            "download it again") from None
    return dict(_pytorch_name(k, v, fmt == "flax") for k, v in tensors.items()), fmt


def _pytorch_name(name: str, value: np.ndarray, flax: bool) -> tuple[str, np.ndarray]:
    """Today's PyTorch spelling of a tensor name (also old checkpoints' LayerNorm gamma/beta)."""
    stem, _, leaf = name.rpartition(".")
    if leaf in ("gamma", "beta"):
        return f"{stem}.{'weight' if leaf == 'gamma' else 'bias'}", value
    if not flax:
        return name, value
    if leaf == "kernel":
        return f"{stem}.weight", value.T
    if leaf in ("scale", "embedding"):
        return f"{stem}.weight", value
    return name, value


def write(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """Write `tensors` to `path` atomically."""
    from safetensors.numpy import save_file
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.{os.getpid()}.tmp")
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp, metadata=dict(metadata))
    os.replace(tmp, path)
