"""Multi-head self-attention that consumes a scheme's `PositionalTerms`.

    logits_h = logit_scale · (q_h k_hᵀ) + logit_bias_h + mask,   probs = softmax(logits) (float32)

q/k come from one fused QKV projection; the scheme's q/k transform (RoPE, BERT-Ad) is applied to them; the bias
(T5, ALiBi, TUPE) is one (1, H, L, L) array shared by every layer and broadcast over the batch, never copied
per row or per layer. With `rows` (B, P) (an MLM encoder's last block, `model.last_layer_rows`) only those queries
are computed: their q rows after the transform, their bias rows (B, H, P, L), keys and values at all L.

Backends: `einsum` (explicit logits; can return attention probabilities; attention-probability dropout);
`xla` / `cudnn` (`jax.nn.dot_product_attention` with that implementation; used when no probabilities are asked
for and attention dropout is off or the pass is deterministic — otherwise the einsum path runs); `pallas`
(`kernels/flash.py`: a flash-attention kernel, Triton on GPU, that also takes attention dropout with 16-bit masks,
bit for bit the mask the einsum path draws from the same key; used on a GPU when no probabilities are asked for
and L is a multiple of 64, with `model.dropout_bits=16` when dropping (and a threefry dropout key if the kernel
hashes the mask itself: `PALLAS_DROPOUT_MASK`) — otherwise, and on every other platform, the einsum path runs: the
same maths and the same masks). A q/k transform
may widen the head dim of q and k (TUPE's concat form); the fused paths then pad v with zeros to match and slice
the output back.

Bias precision on the fused paths: `xla` gets the float32 bias as is — its kernel adds it to float32 logits (bf16
q·k accumulate in float32), so nothing is rounded. cuDNN's kernel takes the bias only in q's dtype (bf16: unit
roundoff u = 2⁻⁸, an ALiBi entry −m·|i−j| ≈ −128 is off by up to 0.5), so `cudnn_inputs` prepares it: causal
ALiBi, whose bias on the allowed keys is m_h·j plus a per-row constant, leaves the bias altogether and enters as
four exact extra q/k dimensions (`key_slope_parts`); any other bias is shifted by its row maximum over the allowed
keys (`fused_bias`; in float32; softmax is shift-invariant per row, so the maths and gradients are unchanged),
which makes the entries near the row's top bias the smallest in magnitude. Rounding error of an entry ≤ u·(its
distance below that top), so it is small where the bias alone carries the softmax mass, but not where q·k lifts a
far entry back up (an error of up to u·|b|); for bits that match float32 use `xla` or `einsum`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from tupe_jax.dropout import Rows, apply_mask16, check_hashes16, keep_bits16, make_dropout, take_rows, threefry_words
from tupe_jax.positional.base import PositionalTerms
from tupe_jax.projection import dense_dot_general
from tupe_jax.sharding import constrain

NEG_INF = -1e30  # finite, so fully masked rows (padding queries) stay NaN-free


def attention_mask(input_mask: Optional[jax.Array], length: int, causal: bool) -> Optional[jax.Array]:
    """Boolean (B|1, 1, L, L) mask, True where a query may attend to a key."""
    mask = None
    if input_mask is not None:
        mask = input_mask.astype(bool)[:, None, None, :]
    if causal:
        tri = jnp.tril(jnp.ones((length, length), bool))[None, None]
        mask = tri if mask is None else mask & tri
    return mask


@jax.custom_vjp
def add_shared_bias(logits: jax.Array, bias: jax.Array) -> jax.Array:
    """logits (B, H, L, L) + bias (1, H, L, L) of the same dtype, broadcast over the batch.

    Same value and gradients as `logits + bias`; the bias cotangent Σ_b g_b is written as a contraction with a
    ones vector, 1ᵀ·g. XLA:CPU (jaxlib 0.10) lowers the plain reduce over the leading batch axis ~50× slower
    than that dot (11 ms vs 0.2 ms for 4 layers of (16, 4, 128, 128), profiled in issue #7), which was most
    of TUPE's step-time overhead over BERT-A.
    """
    return logits + bias


def _add_shared_bias_fwd(logits, bias):
    return logits + bias, None


def _add_shared_bias_bwd(_, g):
    ones = jnp.ones((g.shape[0],), g.dtype)
    return g, jnp.einsum("b,bhqk->hqk", ones, g)[None]


add_shared_bias.defvjp(_add_shared_bias_fwd, _add_shared_bias_bwd)


def pad_values(v: jax.Array, dim: int) -> jax.Array:
    """(B, L, H, d_v) -> (B, L, H, dim) with zeros: the one head dim a kernel wants when q/k were widened (TUPE's
    concat form, the ALiBi key term); the caller slices the output back to d_v."""
    return v if v.shape[-1] == dim else jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, dim - v.shape[-1])))


def fused_bias(bias: Optional[jax.Array], backend: str, dtype: jnp.dtype,
               mask: Optional[jax.Array] = None) -> Optional[jax.Array]:
    """The positional bias handed to `jax.nn.dot_product_attention` (module docstring: bias precision).

    `xla`: float32 unchanged (added to float32 logits, no rounding). `cudnn`: b − max_k b, the maximum over the keys
    that `mask` (B|1, 1, L|1, L) allows in that row (float32, stop-gradient on the max; same softmax and gradients;
    0 where no key is allowed), then cast to the compute dtype, as the kernel requires. A key-padding mask makes
    the result (B, H, L, L), as jax's cuDNN path does anyway when it adds the mask to the bias. A maximum over
    masked keys would be wrong for causal ALiBi: its future keys carry +m·(j − i), up to +511 at 1024 tokens, and
    shifting by that rounds every allowed entry at magnitude ~500 (bf16 spacing 2 there).
    """
    if bias is None or backend == "xla" or bias.dtype == dtype:
        return bias
    bias = bias.astype(jnp.float32)
    if mask is not None:
        top = jnp.max(jnp.where(mask, bias, -jnp.inf), axis=-1, keepdims=True)
        top = jnp.where(jnp.isfinite(top), top, 0.0)
    else:
        top = jnp.max(bias, axis=-1, keepdims=True)
    return (bias - jax.lax.stop_gradient(top)).astype(dtype)


KEY_SLOPE_DIMS = 4      # the extra q/k dimensions of `key_slope_parts`
KEY_SLOPE_BASE = 256    # j = 256·j_hi + j_lo: both parts are integers that bfloat16 holds exactly (≤ 256)
MAX_FOLDED_KEYS = KEY_SLOPE_BASE ** 2


def cudnn_max_head_dim() -> int:
    """The largest head dim cuDNN's flash attention takes on this device: 256 from Hopper (compute capability 9) on,
    128 before and wherever the capability is unknown (jax's own check, `check_is_flash_attention`)."""
    capability = str(getattr(jax.devices()[0], "compute_capability", ""))
    major = capability.split(".")[0]
    return 256 if major.isdigit() and int(major) >= 9 else 128


def key_slope_parts(slopes: jax.Array, scale: float, length: int, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """(H, 4) query and (L, 4) key columns, in `dtype`, whose dot product times `scale` is m_h·j for key j.

    μ = m/scale is split as μ_hi + μ_lo (each rounded to `dtype`; together exact to ~2⁻¹⁶ relative) and
    j = 256·j_hi + j_lo (exact), so [256μ_hi, 256μ_lo, μ_hi, μ_lo]·[j_hi, j_hi, j_lo, j_lo] = (μ_hi + μ_lo)·j: each
    product of two `dtype` numbers is exact in the kernel's float32 accumulator, so the only rounding is the float32
    sum's (≈ 2⁻²⁴·m·j). At m = 1/2, j = 1023 the term is off by ~0.004 logits, against ~1 for a bf16 bias.
    """
    if length > MAX_FOLDED_KEYS:
        raise ValueError(f"key_slope_parts: {length} keys; j_hi must stay ≤ {KEY_SLOPE_BASE} to be exact")
    mu = slopes.astype(jnp.float32) / scale
    mu_hi = mu.astype(dtype)
    mu_lo = (mu - mu_hi.astype(jnp.float32)).astype(dtype)
    j = jnp.arange(length)
    j_hi, j_lo = (j // KEY_SLOPE_BASE).astype(dtype), (j % KEY_SLOPE_BASE).astype(dtype)
    base = jnp.asarray(KEY_SLOPE_BASE, dtype)
    return (jnp.stack([mu_hi * base, mu_lo * base, mu_hi, mu_lo], axis=-1),
            jnp.stack([j_hi, j_hi, j_lo, j_lo], axis=-1))


def cudnn_inputs(q: jax.Array, k: jax.Array, v: jax.Array, terms: PositionalTerms,
                 mask: Optional[jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array, Optional[jax.Array]]:
    """(q, k, v, bias) as cuDNN's kernel takes them: one head dim for all three and the bias in q's dtype. A bias
    with `key_slopes` (causal ALiBi) in a 16-bit dtype leaves as four more q/k dimensions (`key_slope_parts`,
    the head dim then zero-padded to a multiple of 8) and no bias: exact where a bf16 bias is off by up to ~1 logit
    at 1024 tokens; where the padded head dim would pass `cudnn_max_head_dim` (e.g. 128 before Hopper) or the keys
    `MAX_FOLDED_KEYS`, and for any other bias, the bias goes through `fused_bias`. v is zero-padded to the head
    dim; the caller slices the output back."""
    bias = terms.logit_bias
    (batch, length, heads, _), dim = q.shape, q.shape[-1] + KEY_SLOPE_DIMS
    if (bias is not None and terms.key_slopes is not None and jnp.dtype(q.dtype).itemsize < 4
            and dim + (-dim % 8) <= cudnn_max_head_dim() and length <= MAX_FOLDED_KEYS):
        q_part, k_part = key_slope_parts(terms.key_slopes, terms.logit_scale, length, q.dtype)
        pad = [(0, 0)] * 3 + [(0, -dim % 8)]
        q = jnp.pad(jnp.concatenate([q, jnp.broadcast_to(q_part, (batch, length, heads, KEY_SLOPE_DIMS))], -1), pad)
        k = jnp.pad(jnp.concatenate([k, jnp.broadcast_to(k_part[:, None], (batch, length, heads, KEY_SLOPE_DIMS))],
                                    -1), pad)
        bias = None
    return q, k, pad_values(v, q.shape[-1]), fused_bias(bias, "cudnn", q.dtype, mask)


def attention_logits(q: jax.Array, k: jax.Array, terms: PositionalTerms, mask: Optional[jax.Array]) -> jax.Array:
    """(B, L, H, d) x2 -> float32 logits (B, H, L, L) with scale, bias and mask applied."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * terms.logit_scale
    bias = terms.logit_bias
    if bias is not None:
        shared = bias.ndim == 4 and bias.shape[0] == 1 and logits.shape[0] > 1
        logits = add_shared_bias(logits, bias.astype(logits.dtype)) if shared else logits + bias
    if mask is not None:
        logits = jnp.where(mask, logits, NEG_INF)
    return logits


# Whether the fused paths hand a causal model's mask (the bare triangle: no key padding) to the kernel as
# `is_causal=True` rather than as an explicit (1, 1, L, L) array, which jax adds to the bias, so that cuDNN reads an
# L×L bias per head and computes every block; with is_causal it may skip the blocks above the diagonal (and, for
# causal ALiBi folded into q/k, reads no bias at all). The same values (tests/test_fused_bias.py). Off until
# benchmarks/gpu_round2.sh's A/B (gpu_mfu.py --causal_mask explicit,native) shows the gain on a GPU.
NATIVE_CAUSAL_MASK = False


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, terms: PositionalTerms, mask: Optional[jax.Array],
                    backend: str, causal_only: bool = False) -> jax.Array:
    """(B, L, H, d) q/k/v -> (B, L, H, d_v) through `jax.nn.dot_product_attention(implementation=backend)`: `xla`
    with the float32 bias, `cudnn` with `cudnn_inputs`; a widened q/k head dim (TUPE concat form, the ALiBi key
    term) pads v with zeros and slices the output back. `causal_only`: `mask` is the bare causal triangle (see
    `NATIVE_CAUSAL_MASK`)."""
    value_dim, bias = v.shape[-1], terms.logit_bias
    if backend == "cudnn":
        q, k, v, bias = cudnn_inputs(q, k, v, terms, mask)
    v = pad_values(v, q.shape[-1])
    native = causal_only and NATIVE_CAUSAL_MASK
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=None if native else mask, is_causal=native,
                                        scale=terms.logit_scale, implementation=backend)[..., :value_dim]


# `model.attention_backend`: the einsum path (any scheme, dropout, probabilities), jax.nn.dot_product_attention's
# fused implementations (used when no probabilities are asked for and attention dropout is off for the pass), or
# the Pallas flash kernel (with attention dropout too; module docstring).
ATTENTION_BACKENDS = ("einsum", "xla", "cudnn", "pallas")
# Off a GPU the `pallas` backend runs the einsum path; "interpret" runs the kernel through Pallas' interpreter
# instead (exact and slow: what the CPU tests set).
PALLAS_OFF_GPU = "einsum"


# Where the pallas kernel's attention-dropout mask comes from (`kernels/masks.py`): "precomputed", drawn by XLA
# before the kernel, one byte per hash (dropout.keep_bits16), read tile by tile (any dropout generator); or
# "in_kernel", hashed by each kernel from the threefry key's words (threefry keys only; in session 22 its backward
# did not finish compiling on an H200: `PALLAS_IN_KERNEL_DROPOUT_COMPILES_ON_GPU`). The same masks either way.
PALLAS_DROPOUT_MASKS = ("precomputed", "in_kernel")
PALLAS_DROPOUT_MASK = "precomputed"


def pallas_attention(q: jax.Array, k: jax.Array, v: jax.Array, terms: PositionalTerms, mask: Optional[jax.Array],
                     dropout_rate: float, dropout_key: Optional[jax.Array]) -> jax.Array:
    """(B, L, H, d) q/k/v -> (B, L, H, d_v) through `kernels.flash` (dropout, when `dropout_key` is given, with
    keep_mask16's masks for it, from `PALLAS_DROPOUT_MASK`'s source); a widened q/k head dim pads v with zeros, as
    `fused_attention`."""
    from tupe_jax.kernels import flash  # pylint: disable=import-outside-toplevel  # Pallas: only when used
    (batch, length, heads, _), value_dim = q.shape, v.shape[-1]
    v = pad_values(v, q.shape[-1])
    if mask is not None:   # the kernel reads mask rows: a key-padding mask (B, 1, 1, L) is broadcast over them
        mask = jnp.broadcast_to(mask, (mask.shape[0], 1, length, length))
    if PALLAS_DROPOUT_MASK not in PALLAS_DROPOUT_MASKS:
        raise ValueError(f"attention.PALLAS_DROPOUT_MASK = {PALLAS_DROPOUT_MASK!r}: not one of {PALLAS_DROPOUT_MASKS}")
    words = bits = None
    if dropout_key is not None and PALLAS_DROPOUT_MASK == "precomputed":
        bits = keep_bits16(dropout_key, (batch, heads, length, length), 1.0 - dropout_rate)
    elif dropout_key is not None:
        check_hashes16((batch, heads, length, length))    # the kernel hashes keep_bits16's counters itself
        words = threefry_words(dropout_key)
    block_q, block_k = flash.blocks(length)
    return flash.flash_attention(
        q, k, v, terms.logit_bias, mask, words, keep_bits=bits, scale=terms.logit_scale,
        dropout_rate=dropout_rate if dropout_key is not None else 0.0, block_q=block_q, block_k=block_k,
        interpret=jax.default_backend() != "gpu")[..., :value_dim]


# Whether the pallas kernel's backward with in-kernel dropout hashing compiles on a GPU. In session 22 it stalled
# XLA's compile on an H200 (jax 0.11.2; the forward and the dropout-free backward compile in about a second:
# benchmarks/RESULTS.md, GPU round 2), so training refuses that combination there (`model.validate_training`).
# The precomputed masks (the default) take the hash out of the kernels; not yet compiled on a GPU either.
PALLAS_IN_KERNEL_DROPOUT_COMPILES_ON_GPU = False


def pallas_kernel_fits(length: int) -> bool:
    """Whether the pallas kernel can tile a sequence of `length` (on a GPU it then runs: `pallas_runs`)."""
    from tupe_jax.kernels import flash  # pylint: disable=import-outside-toplevel
    return flash.supported(length, flash.blocks(length)[1])


def pallas_runs(length: int) -> bool:
    """Whether the `pallas` backend runs its kernel here for a sequence of `length` (module docstring)."""
    on_gpu = jax.default_backend() == "gpu"
    return (on_gpu or PALLAS_OFF_GPU == "interpret") and pallas_kernel_fits(length)


def bias_rows(bias: jax.Array, rows: jax.Array) -> jax.Array:
    """The query rows `rows` (B, P) of a logit bias (1|B, H, L, L) -> (B, H, P, L)."""
    if bias.shape[0] == 1:        # shared: one gather of whole rows, (H, B, P, L)
        return jnp.moveaxis(jnp.take(bias[0], rows, axis=1), 0, 1)
    return take_rows(bias, Rows(rows[:, None, :, None], 2, bias.shape[2]))


class SelfAttention(nn.Module):
    """`rows` (B, P) int (`__call__`): queries at those positions only (keys and values at all L): the output is
    (B, P, d), the rows of the full output, with the rows of the same attention-dropout masks. Those queries take
    the einsum path, or xla's fused one where the backend is xla or cudnn (cuDNN's kernel refuses an odd P with a
    bias in training), never pallas's kernel (it takes L queries)."""

    num_heads: int
    head_dim: int
    dtype: jnp.dtype = jnp.float32
    dropout_rate: float = 0.0
    backend: str = "einsum"
    dropout_bits: int = 32

    @nn.compact
    def __call__(self, x: jax.Array, terms: PositionalTerms, mask: Optional[jax.Array], deterministic: bool,
                 return_probs: bool = False, causal_only: bool = False, rows: Optional[jax.Array] = None
                 ) -> tuple[jax.Array, Optional[jax.Array]]:
        qkv = nn.DenseGeneral(
            (3, self.num_heads, self.head_dim), dtype=self.dtype, name="qkv", dot_general=dense_dot_general,
            kernel_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed", "qkv", "heads", "kv")),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("qkv", "heads", "kv")))(x)
        qkv = constrain(qkv, ("batch", "length", "qkv", "heads", "kv"))    # (B, L, 3, H, D): heads over tensor
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if terms.qk_transform is not None:
            q, k = terms.qk_transform(q, k)
        prob_rows = None
        if rows is not None:      # queries at `rows` only: their q, bias and mask rows, and their dropout rows
            if mask is not None and mask.shape[2] > 1:
                mask = take_rows(mask, Rows(rows[:, None, :, None], 2, mask.shape[2]))
            length, q = q.shape[1], take_rows(q, Rows(rows[:, :, None, None], 1, q.shape[1]))
            if terms.logit_bias is not None:
                terms = dataclasses.replace(terms, logit_bias=bias_rows(terms.logit_bias, rows))
            prob_rows = Rows(rows[:, None, :, None], 2, length)
        probs, out = None, None
        drop = make_dropout(self.dropout_rate, self.dropout_bits)
        dropping = not deterministic and self.dropout_rate > 0.0
        dropped = lambda p: drop(p, deterministic=deterministic, rows=prob_rows)  # noqa: E731
        if (self.backend == "pallas" and rows is None and not return_probs and pallas_runs(q.shape[1])
                and (not dropping or self.dropout_bits == 16)):
            key = drop.key() if dropping else None          # the rng drop() would draw: the same masks
            if key is None or PALLAS_DROPOUT_MASK == "precomputed" or threefry_words(key) is not None:
                out = pallas_attention(q, k, v, terms, mask, self.dropout_rate, key)
            else:   # hashing in the kernel needs threefry words: the einsum path below applies this rbg draw
                dropped = lambda p: apply_mask16(p, key, self.dropout_rate)  # noqa: E731
        elif self.backend in ("xla", "cudnn") and not return_probs and not dropping:
            # P query rows: cuDNN's kernel refuses an odd P with a bias in training; xla's takes any (the same maths)
            out = fused_attention(q, k, v, terms, mask, "xla" if rows is not None else self.backend, causal_only)
        if out is None:
            probs = jax.nn.softmax(attention_logits(q, k, terms, mask), axis=-1)
            out = jnp.einsum("bhqk,bkhd->bqhd", dropped(probs).astype(self.dtype), v)
        out = constrain(out, ("batch", "length", "heads", "kv"))
        out = nn.DenseGeneral(
            x.shape[-1], axis=(-2, -1), dtype=self.dtype, name="out", dot_general=dense_dot_general,
            kernel_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), ("heads", "kv", "embed")),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)))(out)
        return out, (probs if return_probs else None)
