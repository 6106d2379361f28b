"""The name map between this project's `bert_a` MLM encoder and Hugging Face's BERT (PyTorch names and layouts,
as in every `model.safetensors` on the Hub), and the native map of every other scheme.

BERT map: one row per tensor, `(our param path, part, HF name, layout)`; docs/interop.md prints it as a table.
Layouts (ours <- theirs; HF stores a Linear weight as (out, in), we store a kernel as (in, out)):
    copy        the same array
    linear      ours = W.T
    qkv_kernel  ours[:, part] = W.T.reshape(d, H, d_h)         (query 0, key 1, value 2 of the fused qkv kernel)
    qkv_bias    ours[part] = b.reshape(H, d_h)
    out_kernel  ours = W.T.reshape(H, d_h, d)
    position    a model without segment embeddings (model.type_vocab_size 0): ours = position_embeddings +
                token_type_embeddings[0] (the segment-0 row is folded into the table; export writes a zero
                token_type table). With them (import-hf sets the checkpoint's type_vocab_size) both tables are
                copied as they are.

Native map (any scheme, either objective): the safetensors key is our Flax param path joined with '.', e.g.
`encoder.blocks_0.attention.qkv.kernel`, the array exactly as in the model.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from tupe_jax.config import flatten  # {'a.b.c': leaf} of a nested dict
from tupe_jax.errors import UserError

Row = tuple[str, int | None, str, str]
HEAD = ("head_dense", "head_ln", "head_bias")   # the MLM head (TransformerLM params outside `encoder`)


def _linear(ours: str, theirs: str) -> list[Row]:
    return [(f"{ours}.kernel", None, f"{theirs}.weight", "linear"), (f"{ours}.bias", None, f"{theirs}.bias", "copy")]


def _norm(ours: str, theirs: str) -> list[Row]:
    return [(f"{ours}.scale", None, f"{theirs}.weight", "copy"), (f"{ours}.bias", None, f"{theirs}.bias", "copy")]


def bert_rows(num_layers: int, prefix: str = "bert.", head: bool = True, classifier: bool = False,
              token_types: bool = False) -> list[Row]:
    """The BERT name map for `num_layers` blocks; `head`: the MLM head (`cls.predictions.*`); `classifier`: the
    pooler and classifier of a `SequenceClassifier` (`bert.pooler.dense`, `classifier`); `token_types`: the model
    has segment embeddings (else the segment-0 row is folded into the position table)."""
    e = f"{prefix}embeddings."
    rows: list[Row] = [("encoder.embed.embedding", None, f"{e}word_embeddings.weight", "copy"),
                       ("encoder.positional.table", None, f"{e}position_embeddings.weight",
                        "copy" if token_types else "position"),
                       *_norm("encoder.embed_ln", f"{e}LayerNorm")]
    if token_types:
        rows.append(("encoder.token_type.embedding", None, f"{e}token_type_embeddings.weight", "copy"))
    for i in range(num_layers):
        ours, theirs = f"encoder.blocks_{i}.", f"{prefix}encoder.layer.{i}."
        for part, name in enumerate(("query", "key", "value")):
            rows.append((f"{ours}attention.qkv.kernel", part, f"{theirs}attention.self.{name}.weight", "qkv_kernel"))
            rows.append((f"{ours}attention.qkv.bias", part, f"{theirs}attention.self.{name}.bias", "qkv_bias"))
        rows += [(f"{ours}attention.out.kernel", None, f"{theirs}attention.output.dense.weight", "out_kernel"),
                 (f"{ours}attention.out.bias", None, f"{theirs}attention.output.dense.bias", "copy"),
                 *_norm(f"{ours}ln_attention", f"{theirs}attention.output.LayerNorm"),
                 *_linear(f"{ours}mlp_in", f"{theirs}intermediate.dense"),
                 *_linear(f"{ours}mlp_out", f"{theirs}output.dense"),
                 *_norm(f"{ours}ln_mlp", f"{theirs}output.LayerNorm")]
    if head:
        rows += [*_linear("head_dense", "cls.predictions.transform.dense"),
                 *_norm("head_ln", "cls.predictions.transform.LayerNorm"),
                 ("head_bias", None, "cls.predictions.bias", "copy")]
    if classifier:
        rows += [*_linear("pooler", f"{prefix}pooler.dense"), *_linear("classifier", "classifier")]
    return rows


TOKEN_TYPE = "embeddings.token_type_embeddings.weight"
# Names a BERT checkpoint may hold that carry nothing this model uses (buffers, tied copies, the NSP head).
IGNORED = ("embeddings.position_ids", "cls.predictions.decoder.bias", "cls.seq_relationship.", "pooler.dense.")


# ------------------------------------------------------------------------------------------------ trees
def shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """{dotted path: shape} of a tree of arrays or ShapeDtypeStructs."""
    return {path: tuple(int(d) for d in leaf.shape) for path, leaf in flatten(tree).items()}


# ------------------------------------------------------------------------------------------------ BERT -> ours
def _ours_from(layout: str, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if layout in ("copy", "position"):
        return w
    if layout == "linear":
        return w.T
    if layout == "qkv_kernel":
        return w.T.reshape(shape[0], shape[2], shape[3])
    if layout == "qkv_bias":
        return w.reshape(shape[1], shape[2])
    return w.T.reshape(shape)   # out_kernel


def _theirs_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if layout in ("copy", "position"):
        return shape
    if layout == "linear":
        return shape[::-1]
    if layout == "qkv_kernel":
        return (shape[2] * shape[3], shape[0])
    if layout == "qkv_bias":
        return (shape[1] * shape[2],)
    return (shape[2], shape[0] * shape[1])   # out_kernel


def fill_rows(tensors: dict[str, np.ndarray], want: dict[str, tuple[int, ...]], rows: list[Row], where: str, *,
              theirs_shape: Any, ours_from: Any, column_layout: str, missing_fix: str, shape_what: str,
              shape_fix: str) -> tuple[dict[str, np.ndarray], set]:
    """The name-map loop shared by the importers: for each row (ours, part, theirs, layout) check that `theirs`
    exists with shape `theirs_shape(layout, want[ours])`, convert it with `ours_from(layout, w, shape, part)` and put
    it at `ours` (a `part` fills one slice: columns for `column_layout`, else the leading axis). Returns (params,
    names used); a missing tensor or one of another shape is a UserError naming it and both shapes."""
    filled: dict[str, np.ndarray] = {}
    used = set()
    for ours, part, theirs, layout in rows:
        shape = want[ours]
        expect = theirs_shape(layout, shape)
        if theirs not in tensors:
            raise UserError(f"the checkpoint has no tensor {theirs}", where, missing_fix)
        w = np.asarray(tensors[theirs], np.float32)
        if tuple(w.shape) != expect:
            raise UserError(f"tensor {theirs} has shape {list(w.shape)}, {shape_what} asks for {list(expect)}",
                            where, shape_fix)
        used.add(theirs)
        value = ours_from(layout, w, shape, part)
        if part is None:
            filled[ours] = value
        else:
            target = filled.setdefault(ours, np.zeros(shape, np.float32))
            if layout == column_layout:
                target[:, part] = value
            else:
                target[part] = value
    return filled, used


def params_from_bert(tensors: dict[str, np.ndarray], want: dict[str, tuple[int, ...]], rows: list[Row],
                     where: str) -> tuple[dict[str, np.ndarray], list[str]]:
    """Our params as {dotted path: float32 array} from BERT `tensors` (PyTorch names), for the param shapes `want`
    (see `shapes`); only the rows' paths are filled. Returns (params, HF names not used). A missing tensor or one
    of another shape is a UserError naming it and both shapes.
    """
    filled, used = fill_rows(
        tensors, want, rows, where, theirs_shape=_theirs_shape,
        ours_from=lambda layout, w, shape, part: _ours_from(layout, w, shape), column_layout="qkv_kernel",
        missing_fix="give a BERT checkpoint saved by transformers (BertModel/BertForMaskedLM layout)",
        shape_what="the config.json", shape_fix="make config.json match the weights (hidden_size, heads, layers, "
        "vocab_size)")
    for ours, _, _, layout in rows:
        if layout == "position":
            token_type = next((k for k in tensors if k.endswith(TOKEN_TYPE)), None)
            if token_type is not None:
                used.add(token_type)
                row0 = np.asarray(tensors[token_type], np.float32)[0]
                if np.any(row0 != 0):
                    filled[ours] = filled[ours] + row0[None, :]
    unused = sorted(k for k in tensors if k not in used and not any(s in k for s in IGNORED))
    return filled, unused


def bert_from_params(params: Any, rows: list[Row]) -> dict[str, np.ndarray]:
    """BERT tensors (PyTorch names and layouts, float32, contiguous) from our params; inverse of
    `params_from_bert` (the token-type table is written as zeros)."""
    flat = {path: np.asarray(leaf, np.float32) for path, leaf in flatten(params).items()}
    out: dict[str, np.ndarray] = {}
    for ours, part, theirs, layout in rows:
        w = flat[ours]
        if layout in ("copy", "position"):
            value = w
        elif layout == "linear":
            value = w.T
        elif layout == "qkv_kernel":
            value = w[:, part].reshape(w.shape[0], -1).T
        elif layout == "qkv_bias":
            value = w[part].reshape(-1)
        else:   # out_kernel
            value = w.reshape(-1, w.shape[-1]).T
        out[theirs] = np.ascontiguousarray(value)
        if layout == "position":
            out[theirs.replace("position_embeddings", "token_type_embeddings")] = np.zeros((2, w.shape[1]), np.float32)
    return out
