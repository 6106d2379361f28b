"""Flash attention in Pallas (Triton on GPU) with the positional bias, a mask and 16-bit attention dropout.

    s = scale · q kᵀ + bias,  s = NEG_INF where mask is False,  P = softmax(s),  out = (P ∘ keep / p_keep) · v

the same maths as `attention.py`'s einsum path, but tiled so that no (B, H, L, L) array is written in the forward
(the FlashAttention-2 scheme: an online softmax over key tiles, the log-sum-exp kept per query row, the
probabilities recomputed in the backward). The dropout mask of element (b, h, i, j) is bit for bit
`dropout.keep_mask16(key, (B, H, L, L), 1 − rate)`, the einsum path's mask for the same key, so the two backends
compute the same model, checkpoints resume across them, and a test compares them on the CPU (interpret mode). The
kernels read it from `keep_bits` (`dropout.keep_bits16`, drawn by XLA once per call, one byte per hash) or hash
it themselves from the key's words (`key`): `masks.py`. keep_mask16 takes four masks from one hash: with Q = L/4,
hash (b, h, i, c) gives columns c, c+Q, c+2Q, c+3Q. So a key tile here is not contiguous: tile n holds the columns
t·Q + n·w + [0, w) for the quarters t = 0..3, where w = block_k/4, and each hash serves four of its elements.

Shapes: q, k, v (B, L, H, d); bias (B|1, H|1, L, L) float32; mask (B|1, 1, L, L) bool; keep_bits (B, H, L, L/4)
int8, or key uint32 (2,) (the threefry key data of the dropout rng); out (B, L, H, d). d is padded with zeros to a
power of two ≥ 16 (exact). L must be a multiple of 64 (`supported`). The bias gradient, only where the bias is
differentiated (`custom_vjp` symbolic zeros), has a kernel of its own: per tile of a bias entry, dS summed in a
fixed order over the (b, h) pairs that share it, P and dP recomputed there; no (B, H, L, L) array of dS is
written. Written for one device: no sharding rule tells XLA how to split the kernel over several.
`interpret=True` runs it through Pallas' interpreter (any platform; the CPU tests), otherwise Pallas lowers it to
Triton (GPU only).

    flash_attention(q, k, v, bias, mask, key, *, keep_bits, scale, dropout_rate, block_q, block_k, interpret)
    supported(length, block_k) -> bool;   blocks(length) -> (block_q, block_k)
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from tupe_jax.dropout import threshold16
from tupe_jax.kernels import masks
from tupe_jax.kernels.calls import block_specs, run

NEG_INF = -1e30        # attention.NEG_INF: finite, so fully masked rows stay NaN-free (a uniform softmax)
MIN_TILE = 16          # Triton's smallest dot operand side: a quarter of a key tile is at least this wide
TRITON_CALL = "__gpu$xla.gpu.triton"   # the custom call a Triton kernel lowers to (the GPU scripts look for it)
BLOCK_Q, BLOCK_K = 64, 128   # tile sizes (`blocks`); the GPU benchmark may set others
# the backward's key tile: its dK/dV kernel keeps 2 × block_k × d float32 accumulators per program; 64 keys at d 64
# are 8192 floats, 64 registers a thread at 4 warps (FlashAttention-2's usual); 128 would double that
BACKWARD_BLOCK_K = 64


def blocks(length: int) -> tuple[int, int]:
    """(query tile, key tile) for `length`: BLOCK_Q and BLOCK_K, each halved (not below 64) until it divides it."""
    def fit(block: int) -> int:
        while block > 4 * MIN_TILE and length % block:
            block //= 2
        return block
    return fit(BLOCK_Q), fit(BLOCK_K)


def supported(length: int, block_k: int = 64) -> bool:
    """Whether a sequence of `length` tokens can be tiled (key tiles of `block_k`, four quarters ≥ 16 wide)."""
    return length % block_k == 0 and block_k % (4 * MIN_TILE) == 0


class _Spec:
    """The static description of one call: sizes, which optional inputs exist, dropout, tiles."""

    def __init__(self, q, bias, mask, scale, rate, block_q, block_k, precomputed=False):
        self.batch, self.length, self.heads, self.dim = q.shape
        self.precomputed = bool(precomputed and rate > 0)    # the mask source: keep_bits, else the key (masks.py)
        self.scale, self.rate = float(scale), float(rate)
        self.bias_batched = bias is not None and bias.shape[0] > 1
        self.bias_headed = bias is not None and bias.shape[1] > 1
        self.has_bias, self.has_mask = bias is not None, mask is not None
        self.mask_batched = mask is not None and mask.shape[0] > 1
        self.bq, self.bk = block_q, block_k
        self.quarter, self.w = self.length // 4, block_k // 4
        self.threshold = threshold16(1.0 - rate) if rate > 0 else 0     # keep_mask16's, for the same rate
        self.inv_keep = 65536.0 / self.threshold if rate > 0 else 1.0     # the scale of a kept value


def _scores(spec: _Spec, q, ks, bias_ref, mask_ref, rows, starts, bias_at=(), mask_at=()):
    """The four (bq, w) logit tiles of one key tile (its quarters' keys `ks` at columns `starts`): scale·q kᵀ +
    bias, NEG_INF where masked; and the masks. `bias_at`, `mask_at`: leading indices into a bias or mask ref
    that holds more than the program's (rows, keys) plane."""
    out, kept = [], []
    for k, start in zip(ks, starts):
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * spec.scale
        if spec.has_bias:
            s = s + bias_ref[(*bias_at, rows, pl.ds(start, spec.w))]
        allowed = None
        if spec.has_mask:
            allowed = mask_ref[(*mask_at, rows, pl.ds(start, spec.w))] != 0
            s = jnp.where(allowed, s, NEG_INF)
        out.append(s)
        kept.append(allowed)
    return out, kept


def _ds(spec: _Spec, s, allowed, keep, lse, delta, do, v):
    """One (bq, w) tile's P = exp(s − lse) and dS = P ∘ (dP − delta), zero where masked, with dP = dO vᵀ taken
    through the dropout mask `keep` (None: no dropout). lse, delta: the tile's (bq,) rows."""
    p = jnp.exp(s - lse[:, None])
    dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if keep is not None:
        dp = jnp.where(keep, dp * spec.inv_keep, 0.0)
    ds = p * (dp - delta[:, None])
    if allowed is not None:
        ds = jnp.where(allowed, ds, 0.0)
    return p, ds


def _forward_kernel(spec: _Spec, q_ref, k_ref, v_ref, bias_ref, mask_ref, source_ref, o_ref, lse_ref):
    i, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q = q_ref[...]
    rows = slice(None)

    def body(n, carry):
        m, l, acc = carry
        starts = [t * spec.quarter + n * spec.w for t in range(4)]
        s, _ = _scores(spec, q, [k_ref[pl.ds(x, spec.w), :] for x in starts], bias_ref, mask_ref, rows, starts)
        m_new = jnp.maximum(m, functools.reduce(jnp.maximum, [jnp.max(x, axis=1) for x in s]))
        alpha = jnp.exp(m - m_new)
        p = [jnp.exp(x - m_new[:, None]) for x in s]
        l = l * alpha + functools.reduce(jnp.add, [jnp.sum(x, axis=1) for x in p])
        if spec.rate > 0:
            keeps = masks.tile_keeps(spec, source_ref, b, h, i * spec.bq, rows, n * spec.w)
            p = [jnp.where(keep, x * spec.inv_keep, 0.0) for keep, x in zip(keeps, p)]
        acc = acc * alpha[:, None]
        for start, x in zip(starts, p):
            acc = acc + jnp.dot(x.astype(v_ref.dtype), v_ref[pl.ds(start, spec.w), :],
                                preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((spec.bq,), -jnp.inf, jnp.float32), jnp.zeros((spec.bq,), jnp.float32),
            jnp.zeros((spec.bq, spec.dim), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, spec.length // spec.bk, body, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _dkv_kernel(spec: _Spec, q_ref, k_ref, v_ref, bias_ref, mask_ref, source_ref, do_ref, lse_ref, delta_ref, dk_ref,
                dv_ref):
    n, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    starts = [t * spec.quarter + n * spec.w for t in range(4)]
    ks = [k_ref[pl.ds(s, spec.w), :] for s in starts]
    vs = [v_ref[pl.ds(s, spec.w), :] for s in starts]

    def body(i, carry):
        dks, dvs = carry
        rows = pl.ds(i * spec.bq, spec.bq)
        q, do = q_ref[rows, :], do_ref[rows, :]
        s, allowed = _scores(spec, q, ks, bias_ref, mask_ref, rows, starts)
        lse, delta = lse_ref[rows], delta_ref[rows]
        keeps = masks.tile_keeps(spec, source_ref, b, h, i * spec.bq, rows, n * spec.w) if spec.rate > 0 else None
        new_dks, new_dvs = [], []
        for t in range(4):
            keep = keeps[t] if keeps else None
            p, ds = _ds(spec, s[t], allowed[t], keep, lse, delta, do, vs[t])
            pd = jnp.where(keep, p * spec.inv_keep, 0.0) if keeps else p
            new_dvs.append(dvs[t] + jax.lax.dot_general(pd.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                                                        preferred_element_type=jnp.float32))
            new_dks.append(dks[t] + jax.lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                                                        preferred_element_type=jnp.float32))
        return new_dks, new_dvs

    zeros = [jnp.zeros((spec.w, spec.dim), jnp.float32) for _ in range(4)]
    dks, dvs = jax.lax.fori_loop(0, spec.length // spec.bq, body, (zeros, list(zeros)))
    for start, dk, dv in zip(starts, dks, dvs):
        dk_ref[pl.ds(start, spec.w), :] = (dk * spec.scale).astype(dk_ref.dtype)
        dv_ref[pl.ds(start, spec.w), :] = dv.astype(dv_ref.dtype)


def _dq_kernel(spec: _Spec, q_ref, k_ref, v_ref, bias_ref, mask_ref, source_ref, do_ref, lse_ref, delta_ref, dq_ref):
    i, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def body(n, dq):
        starts = [t * spec.quarter + n * spec.w for t in range(4)]
        ks = [k_ref[pl.ds(x, spec.w), :] for x in starts]
        s, allowed = _scores(spec, q, ks, bias_ref, mask_ref, slice(None), starts)
        keeps = (masks.tile_keeps(spec, source_ref, b, h, i * spec.bq, slice(None), n * spec.w)
                 if spec.rate > 0 else None)
        for t, start in enumerate(starts):
            _, ds = _ds(spec, s[t], allowed[t], keeps[t] if keeps else None, lse, delta, do,
                        v_ref[pl.ds(start, spec.w), :])
            dq = dq + jnp.dot(ds.astype(q.dtype), ks[t], preferred_element_type=jnp.float32)
        return dq

    dq = jax.lax.fori_loop(0, spec.length // spec.bk, body, jnp.zeros((spec.bq, spec.dim), jnp.float32))
    dq_ref[...] = (dq * spec.scale).astype(dq_ref.dtype)


def _bias_entry(spec: _Spec, g):
    """Bias entry g (of the bias's batch × heads entries, row-major) -> its (batch, head) indices."""
    return (g, 0) if not spec.bias_headed else (g // spec.heads, g % spec.heads)   # (no `% 1`: Triton's lowering)


def _dbias_kernel(spec: _Spec, q_ref, k_ref, v_ref, bias_ref, mask_ref, source_ref, do_ref, lse_ref, delta_ref,
                  dbias_ref):
    """dS summed over the (b, h) pairs that share bias entry g, on one (query tile i, key tile n) of it. q, k, v,
    dO, lse, delta, the bias and the mask come whole; dbias as the entry's (bq, L) rows."""
    i, n, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(i * spec.bq, spec.bq)
    starts = [t * spec.quarter + n * spec.w for t in range(4)]
    per_b = 1 if spec.bias_batched else spec.batch
    per_h = 1 if spec.bias_headed else spec.heads
    b0, h0 = _bias_entry(spec, g)

    def body(j, acc):
        b, h = (b0 + j // per_h, h0 + j % per_h) if per_h > 1 else (b0 + j, h0)   # (no `% 1`: Triton's lowering)
        q, do = q_ref[b, rows, h, :], do_ref[b, rows, h, :]
        ks = [k_ref[b, pl.ds(x, spec.w), h, :] for x in starts]
        s, allowed = _scores(spec, q, ks, bias_ref, mask_ref, rows, starts, bias_at=(b0, h0),
                             mask_at=(b if spec.mask_batched else 0, 0))
        lse, delta = lse_ref[b, h, rows], delta_ref[b, h, rows]
        keeps = (masks.tile_keeps(spec, source_ref, b, h, i * spec.bq, rows, n * spec.w, at=(b, h))
                 if spec.rate > 0 else None)
        return [acc[t] + _ds(spec, s[t], allowed[t], keeps[t] if keeps else None, lse, delta, do,
                             v_ref[b, pl.ds(start, spec.w), h, :])[1] for t, start in enumerate(starts)]

    acc = jax.lax.fori_loop(0, per_b * per_h, body, [jnp.zeros((spec.bq, spec.w), jnp.float32) for _ in range(4)])
    for start, x in zip(starts, acc):
        dbias_ref[:, pl.ds(start, spec.w)] = x


# ================================================================================================ calls
def _forward(spec: _Spec, q, k, v, bias, mask, source, interpret: bool):
    q_spec, kv, bias_spec, mask_spec, source_spec = block_specs(spec, full_q=False, full_rows=False)
    out_specs = [pl.BlockSpec((None, spec.bq, None, spec.dim), lambda n, b, h: (b, n, h, 0)),
                 pl.BlockSpec((None, None, spec.bq), lambda n, b, h: (b, h, n))]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((spec.batch, spec.heads, spec.length), jnp.float32)]
    grid = (spec.length // spec.bq, spec.batch, spec.heads)
    return run(functools.partial(_forward_kernel, spec), grid,
               [q_spec, kv, kv, bias_spec, mask_spec, source_spec], [q, k, v, bias, mask, source], out_specs,
               out_shape, interpret, "flash_forward")


def _backward(spec: _Spec, bias_grad: bool, q, k, v, bias, mask, source, out, lse, do, interpret: bool):
    delta = jnp.einsum("blhd,blhd->bhl", out.astype(jnp.float32), do.astype(jnp.float32))
    args = [q, k, v, bias, mask, source, do, lse, delta]
    dk, dv = _dkv(spec, args, interpret)
    return _dq(spec, args, interpret), dk, dv, (_bias_grad(spec, args, interpret) if bias_grad else None)


def _dkv(spec: _Spec, args, interpret: bool):
    """(dK, dV) over a (key tile, b, h) grid; args = [q, k, v, bias, mask, source, dO, lse, delta]."""
    q_full, kv, bias_full, mask_full, source_spec = block_specs(spec, full_q=True, full_rows=True)
    row = pl.BlockSpec((None, None, spec.length), lambda n, b, h: (b, h, 0))
    k, v = args[1], args[2]
    return run(functools.partial(_dkv_kernel, spec), (spec.length // spec.bk, spec.batch, spec.heads),
               [q_full, kv, kv, bias_full, mask_full, source_spec, q_full, row, row], args,
               [kv, kv],    # dK, dV: each program writes the four quarter slices of its key tile
               [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)], interpret,
               "flash_dkv")


def _dq(spec: _Spec, args, interpret: bool):
    """dQ over a (query tile, b, h) grid; args as `_dkv`'s."""
    q_tile, kv, bias_rows, mask_rows, source_spec = block_specs(spec, full_q=False, full_rows=False)
    row_tile = pl.BlockSpec((None, None, spec.bq), lambda n, b, h: (b, h, n))
    q = args[0]
    return run(functools.partial(_dq_kernel, spec), (spec.length // spec.bq, spec.batch, spec.heads),
               [q_tile, kv, kv, bias_rows, mask_rows, source_spec, q_tile, row_tile, row_tile], args, q_tile,
               jax.ShapeDtypeStruct(q.shape, q.dtype), interpret, "flash_dq")


def _bias_grad(spec: _Spec, args, interpret: bool):
    """dbias, the bias's shape: `_dbias_kernel` over a (query tile, key tile, bias entry) grid."""
    L, bias = spec.length, args[3]
    entries = bias.shape[0] * bias.shape[1]
    whole = lambda x: pl.BlockSpec(x.shape, lambda i, n, g: (0,) * x.ndim)  # noqa: E731  indexed inside
    rows = pl.BlockSpec((None, None, spec.bq, L), lambda i, n, g: (*_bias_entry(spec, g), i, 0))
    specs = [whole(x) if x is not None else None for x in args]
    return run(functools.partial(_dbias_kernel, spec), (L // spec.bq, L // spec.bk, entries), specs, args, rows,
               jax.ShapeDtypeStruct(bias.shape, jnp.float32), interpret, "flash_dbias")


def _is_bits(source) -> bool:
    return source is not None and source.ndim == 4


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _flash(q, k, v, bias, mask, source, scale, rate, block_q, block_k, interpret):
    """`source`: the dropout mask's, keep_bits (B, H, L, L/4) int8 or the key's words uint32 (2,) (masks.py)."""
    spec = _Spec(q, bias, mask, scale, rate, block_q, block_k, precomputed=_is_bits(source))
    return _forward(spec, q, k, v, bias, mask, source, interpret)[0]


def _flash_fwd(*primals):
    """`symbolic_zeros`: each array comes as (value, perturbed); an absent input (None) comes as None."""
    (q, k, v, bias, mask, source), static = [getattr(x, "value", x) for x in primals[:6]], primals[6:]
    spec = _Spec(q, bias, mask, *static[:4], precomputed=_is_bits(source))
    out, lse = _forward(spec, q, k, v, bias, mask, source, static[4])
    bias_grad = bias is not None and bool(primals[3].perturbed)
    return out, (q, k, v, bias, mask, source, out, lse, bias_grad)


def _flash_bwd(scale, rate, block_q, block_k, interpret, residuals, do):
    q, k, v, bias, mask, source, out, lse, bias_grad = residuals
    if isinstance(do, jax.custom_derivatives.SymbolicZero):
        do = jnp.zeros(do.shape, do.dtype)
    spec = _Spec(q, bias, mask, scale, rate, block_q, min(block_k, BACKWARD_BLOCK_K), precomputed=_is_bits(source))
    dq, dk, dv, dbias = _backward(spec, bias_grad, q, k, v, bias, mask, source, out, lse, do, interpret)
    return dq, dk, dv, (dbias.astype(bias.dtype) if dbias is not None else None), None, None


_flash.defvjp(_flash_fwd, _flash_bwd, symbolic_zeros=True)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: Optional[jax.Array] = None,
                    mask: Optional[jax.Array] = None, key: Optional[jax.Array] = None, *,
                    keep_bits: Optional[jax.Array] = None, scale: float, dropout_rate: float = 0.0,
                    block_q: int = 64, block_k: int = 64, interpret: bool = False) -> jax.Array:
    """(B, L, H, d) q, k, v -> (B, L, H, d) attention output (module docstring). When `dropout_rate` > 0 the mask
    comes from `keep_bits`, `dropout.keep_bits16(rng, (B, H, L, L), 1 − dropout_rate)`, or, without it, is hashed
    in the kernels from `key`, the dropout rng's threefry key data, uint32 (2,) (masks.py)."""
    batch, length, heads, dim = q.shape
    if not supported(length, block_k) or length % block_q:
        raise ValueError(f"flash_attention: length {length} does not tile into blocks {block_q}x{block_k}")
    if dropout_rate > 0 and key is None and keep_bits is None:
        raise ValueError("flash_attention: dropout needs keep_bits or the rng's key data")
    bits_shape = (batch, heads, length, length // 4)
    if keep_bits is not None and (keep_bits.shape != bits_shape or keep_bits.dtype != jnp.int8):
        raise ValueError(f"flash_attention: keep_bits is {keep_bits.dtype}{list(keep_bits.shape)}, not int8"
                         f"{list(bits_shape)} (dropout.keep_bits16 of the (B, H, L, L) mask)")
    padded = max(MIN_TILE, 1 << math.ceil(math.log2(dim)))
    if padded != dim:    # zeros in the head dimension change no dot product; the output's extra columns are sliced
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, padded - dim))) for x in (q, k, v))
    source = None if dropout_rate == 0 else keep_bits if keep_bits is not None else key.astype(jnp.uint32)
    mask = mask.astype(jnp.int8) if mask is not None else None
    bias = bias.astype(jnp.float32) if bias is not None else None
    out = _flash(q, k, v, bias, mask, source, float(scale), float(dropout_rate), block_q, block_k, interpret)
    return out[..., :dim]
