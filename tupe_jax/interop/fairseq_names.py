"""The name map between the TUPE authors' fairseq BERT (`BertModel` of github.com/guolinke/TUPE) and our `tupe_a` /
`tupe_r` TransformerLM.

One row per tensor: `(our param path, part, fairseq state-dict name, layout)`; docs/interop.md prints it. d = width,
H = heads, d_h = d / H. fairseq stores a Linear weight as (out, in); its attention has one fused `in_proj_weight`
(3d, d) whose rows are query, key, value in that order, heads contiguous (row h·d_h + k).
Layouts (ours <- theirs):
    copy         the same array
    linear       ours = W.T
    in_kernel    ours[:, part] = W[part·d:(part+1)·d].T.reshape(d, H, d_h)   (our fused qkv kernel (d, 3, H, d_h))
    in_bias      ours[part] = b[part·d:(part+1)·d].reshape(H, d_h)
    out_kernel   ours = W.T.reshape(H, d_h, d)
    head_kernel  ours = W.T.reshape(d, H, d_h)    (U^Q, U^K: fairseq's pos_q_linear / pos_k_linear, split per head)
    head_bias    ours = b.reshape(H, d_h)
The position table has max_positions + 1 rows in both (row 0: θ1 of the untied [CLS], row 1: θ2 and token 0,
token t: row t + 1); the relative table 33 rows (32 T5 buckets and the [CLS] column's own bucket).
"""
from __future__ import annotations

import numpy as np

from tupe_jax.interop.names import fill_rows

Row = tuple[str, "int | None", str, str]
ENCODER = "sentence_encoder."
# State-dict names that carry nothing to import: fine-tuning heads and the output matrix (tied to embed_tokens).
IGNORED = ("classification_heads.", "lm_head.weight")


def _pair(ours: str, theirs: str, kernel: str = "linear", bias: str = "copy") -> list[Row]:
    return [(f"{ours}.kernel", None, f"{theirs}.weight", kernel), (f"{ours}.bias", None, f"{theirs}.bias", bias)]


def _norm(ours: str, theirs: str) -> list[Row]:
    return [(f"{ours}.scale", None, f"{theirs}.weight", "copy"), (f"{ours}.bias", None, f"{theirs}.bias", "copy")]


def fairseq_rows(num_layers: int, relative: bool, prefix: str = "decoder.") -> list[Row]:
    """The map for `num_layers` blocks; `relative`: TUPE-R's bucket table; `prefix`: 'decoder.' (the BertModel of
    the TUPE code) or 'encoder.' (later fairseq naming)."""
    s = f"{prefix}{ENCODER}"
    p = "encoder.positional."
    rows: list[Row] = [("encoder.embed.embedding", None, f"{s}embed_tokens.weight", "copy"),
                       *_norm("encoder.embed_ln", f"{s}emb_layer_norm"),
                       (f"{p}proj.pos_table", None, f"{s}pos.weight", "copy"),
                       *_norm(f"{p}proj.pos_ln", f"{s}pos_ln"),
                       *_pair(f"{p}proj.pos_q", f"{s}pos_q_linear", "head_kernel", "head_bias"),
                       *_pair(f"{p}proj.pos_k", f"{s}pos_k_linear", "head_kernel", "head_bias")]
    if relative:
        rows.append((f"{p}rel.rel_bias", None, f"{s}relative_attention_bias.weight", "copy"))
    for i in range(num_layers):
        ours, theirs = f"encoder.blocks_{i}.", f"{s}layers.{i}."
        for part in range(3):
            rows.append((f"{ours}attention.qkv.kernel", part, f"{theirs}self_attn.in_proj_weight", "in_kernel"))
            rows.append((f"{ours}attention.qkv.bias", part, f"{theirs}self_attn.in_proj_bias", "in_bias"))
        rows += [*_pair(f"{ours}attention.out", f"{theirs}self_attn.out_proj", "out_kernel"),
                 *_norm(f"{ours}ln_attention", f"{theirs}self_attn_layer_norm"),
                 *_pair(f"{ours}mlp_in", f"{theirs}fc1"),
                 *_pair(f"{ours}mlp_out", f"{theirs}fc2"),
                 *_norm(f"{ours}ln_mlp", f"{theirs}final_layer_norm")]
    rows += [*_pair("head_dense", f"{prefix}lm_head.dense"), *_norm("head_ln", f"{prefix}lm_head.layer_norm"),
             ("head_bias", None, f"{prefix}lm_head.bias", "copy")]
    return rows


def _theirs_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if layout == "copy":
        return shape
    if layout == "linear":
        return shape[::-1]
    if layout == "in_kernel":                       # ours (d, 3, H, d_h)
        return (3 * shape[2] * shape[3], shape[0])
    if layout == "in_bias":                         # ours (3, H, d_h)
        return (3 * shape[1] * shape[2],)
    if layout == "out_kernel":                      # ours (H, d_h, d)
        return (shape[2], shape[0] * shape[1])
    if layout == "head_kernel":                     # ours (d, H, d_h)
        return (shape[1] * shape[2], shape[0])
    return (shape[0] * shape[1],)                   # head_bias: ours (H, d_h)


def _ours(layout: str, w: np.ndarray, shape: tuple[int, ...], part: int | None) -> np.ndarray:
    if layout == "copy":
        return w
    if layout == "linear":
        return w.T
    if layout == "in_kernel":
        d = shape[0]
        return w[part * d:(part + 1) * d].T.reshape(d, shape[2], shape[3])
    if layout == "in_bias":
        n = shape[1] * shape[2]
        return w[part * n:(part + 1) * n].reshape(shape[1], shape[2])
    return w.T.reshape(shape) if layout in ("out_kernel", "head_kernel") else w.reshape(shape)


def params_from_fairseq(tensors: dict[str, np.ndarray], want: dict[str, tuple[int, ...]], rows: list[Row],
                        where: str) -> tuple[dict[str, np.ndarray], list[str]]:
    """Our params {dotted path: float32 array} for the shapes `want`; returns (params, state-dict names no row
    used, bar IGNORED ones). A missing tensor or one of another shape is a UserError naming it and both shapes."""
    filled, used = fill_rows(
        tensors, want, rows, where, theirs_shape=_theirs_shape, ours_from=_ours, column_layout="in_kernel",
        missing_fix="give a checkpoint of the TUPE code's BertModel (github.com/guolinke/TUPE)",
        shape_what="the stored args", shape_fix="give the checkpoint whose args describe its weights")
    unused = sorted(k for k in tensors if k not in used and not any(k.split(".", 1)[-1].startswith(i) or
                                                                       k.startswith(i) for i in IGNORED))
    return filled, unused
