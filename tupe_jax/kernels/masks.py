"""Where a tile of `flash.py`'s dropout mask comes from: bit for bit `dropout.keep_mask16(key, (B, H, L, L), p)`.

keep_mask16 makes four masks from one Threefry hash: with Q = L/4, hash (b, h, i, c) — counter ((b·H + h)·L + i)·Q
+ c — gives columns c, c+Q, c+2Q, c+3Q from the four 16-bit halves of its two words (u < t keeps). A kernel's key
tile n therefore holds the columns t·Q + n·w + [0, w) for the quarters t = 0..3, and each hash serves one element
of each quarter. Two sources (`flash_attention`'s `keep_bits` or `key`):

- **precomputed** (`attention.PALLAS_DROPOUT_MASK = "precomputed"`, the default): XLA draws the mask once, before
  the forward kernel, packed one byte per hash (`dropout.keep_bits16`: bit t = quarter t; (B, H, L, Q) int8, a
  quarter of a byte per element: 25 MB a layer at BERT-base, batch 32, seq 512), and every kernel (forward, dK/dV,
  dQ, dbias) loads its (rows, w) byte tile and shifts the bits out. Any of keep_mask16's generators works.
- **in_kernel**: each kernel hashes its own tile (`threefry.py`) from the key's two words; no mask in memory, the
  hash recomputed by every kernel. In session 22 its backward did not finish compiling on an H200.

    tile_keeps(spec, source_ref, b, h, row_start, rows, column_start, at=()) -> the four (bq, w) keep masks
    source_spec(spec, rows_per_program) -> the BlockSpec of the source over a (tile, b, h) grid
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from tupe_jax.kernels.threefry import threefry2x32


def _row_index(spec, b, h, start):
    """(bq, w) uint32 hash counters' row part ((b·H + h)·L + i)·Q for the query rows start + [0, bq)."""
    rows = jax.lax.broadcasted_iota(jnp.int32, (spec.bq, spec.w), 0) + start
    base = (b * spec.heads + h).astype(jnp.uint32) * jnp.uint32(spec.length)
    return (base + rows.astype(jnp.uint32)) * jnp.uint32(spec.quarter)


def _hashed(spec, key_ref, b, h, row_start, column_start):
    """The four (bq, w) keep masks, hashed here from the key words at hash columns column_start + [0, w)."""
    cols = jax.lax.broadcasted_iota(jnp.int32, (spec.bq, spec.w), 1) + column_start
    row_part = _row_index(spec, b, h, row_start)
    w0, w1 = threefry2x32(key_ref[0], key_ref[1], row_part + cols.astype(jnp.uint32), jnp.zeros_like(row_part))
    t = jnp.uint32(spec.threshold)
    return ((w0 & jnp.uint32(0xFFFF)) < t, (w0 >> jnp.uint32(16)) < t, (w1 & jnp.uint32(0xFFFF)) < t,
            (w1 >> jnp.uint32(16)) < t)


def tile_keeps(spec, source_ref, b, h, row_start, rows, column_start, at=()):
    """The four (bq, w) keep masks of query rows row_start + [0, bq) (`rows`: their index into a precomputed
    source's block; `at`: leading indices where that block holds more than one (b, h)) at hash columns
    column_start + [0, w), one per quarter t = 0..3, from either source (module docstring)."""
    if not spec.precomputed:
        return _hashed(spec, source_ref, b, h, row_start, column_start)
    byte = source_ref[(*at, rows, pl.ds(column_start, spec.w))].astype(jnp.int32)
    return tuple(((byte >> t) & 1) != 0 for t in range(4))


def source_spec(spec, rows_per_program: int):
    """BlockSpec of the mask source over a (tile, b, h) grid: the key words whole, or the precomputed bytes of
    the program's (b, h) — all L rows (`rows_per_program` = L) or its query tile of bq rows."""
    if not spec.precomputed:
        return pl.BlockSpec((2,), lambda n, b, h: (0,))
    whole = rows_per_program == spec.length
    return pl.BlockSpec((None, None, rows_per_program, spec.quarter),
                        lambda n, b, h: (b, h, 0 if whole else n, 0))
