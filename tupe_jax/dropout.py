"""Dropout with a choice of mask precision (`model.dropout_bits`).

    y = x · keep / p,   keep ~ Bernoulli(p) per element,   p = 1 − rate

32: `flax.linen.Dropout` itself — with JAX's partitionable threefry every mask element costs one threefry2x32 hash
(two 32-bit words XORed into one uniform float). What every run made before the key existed used (they read it
as 32: workdir/meta.py ADDED_DEFAULTS), and the ModelConfig default.

16 (configs/pretrain.py's default for new runs): each hash's two 32-bit words give four 16-bit uniforms
u ∈ {0..65535}; keep = u < t with t = round(p·2¹⁶), so P(keep) = t/2¹⁶ exactly and y = x · keep · 2¹⁶/t
(unbiased: E[y] = x). For rate 0.1, t = 58982: the realised rate is 0.1000061 instead of 0.1, a difference of
6·10⁻⁶. A quarter of the hashing for the same masks' statistics, but other bits: a run's masks depend on the
choice (like `train.dropout_rng`), its statistics do not. On the CPU reference step flax's 32-bit masks cost
1.08-1.09x the CPU time of these (benchmarks/RESULTS.md). With a non-threefry key (`train.dropout_rng =
rbg|unsafe_rbg`) the 32-bit words come from `jax.random.bits`: two masks per word. On XLA:CPU the threefry hash
of the 16-bit masks is `kernels/threefry.py`'s, written out as uint32 operations: JAX's primitive's words without
its rolled loop (`_hash_words`).

    make_dropout(rate, bits) -> nn.Module          Dropout (flax's masks) for 32, Dropout16 for 16
    keep_mask16(rng, shape, keep_prob) -> (bool mask, realised keep probability)
    hashes16(shape) -> the hashes a mask of `shape` takes; check_hashes16(shape) refuses more than 2³² (ValueError)
    keep_bits16(rng, shape, keep_prob) -> the same mask, four bits a byte (one byte per hash)
    threshold16(keep_prob) -> t, the 16-bit threshold of keep_mask16 (and of kernels/flash.py's masks)
    apply_mask16(x, rng, rate) -> x masked and scaled (what Dropout16 does with the rng it draws)
    Rows(index, axis, length); take_rows(x, rows) -> some rows of a mask's full shape (both modules' `rows=`: a
        layer computed at some positions only draws those rows of the masks the whole sequence would get)
    threefry2x32_primitive(k0, k1, x0, x1) -> (y0, y1)   JAX's threefry primitive (the hash off XLA:CPU)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p

from tupe_jax.kernels.threefry import threefry2x32

DROPOUT_BITS = (32, 16)
MAX_HASHES16 = 1 << 32     # keep_mask16's counters are one uint32 word: distinct for this many hashes per mask


@dataclasses.dataclass(frozen=True)
class Rows:
    """Rows `index` along `axis` of an array whose full extent there is `length`: `index` is an integer array that
    broadcasts to the array's shape with `axis` of the rows' count (e.g. (B, P, 1) for rows of a (B, L, d) array).
    A mask drawn with `rows` is those rows of the mask the full shape gets from the same rng, bit for bit."""
    index: jax.Array
    axis: int
    length: int

    def full(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The full shape whose rows `shape` (the rows' own) holds."""
        return shape[:self.axis] + (self.length,) + shape[self.axis + 1:]


def take_rows(x: jax.Array, rows: Rows) -> jax.Array:
    """x's rows `rows.index` along `rows.axis` (x has the full extent there). The index keeps its size-1 axes: jax
    then gathers whole rows (slices), where a broadcast index would have it gather every element on its own."""
    return jnp.take_along_axis(x, rows.index.astype(jnp.int32), axis=rows.axis)


def _counters(shape: tuple[int, ...], rows: Optional[Rows] = None) -> jax.Array:
    """uint32 array of `shape` holding each element's row-major index (in `rows.full(shape)` where rows are given:
    an element of row r along rows.axis counts as at r): built from broadcasted iotas, which the SPMD partitioner
    shards like the data (each device makes only its own slice)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in range(len(shape) - 1, -1, -1):
        if rows is not None and axis == rows.axis:
            at, extent = jnp.broadcast_to(rows.index.astype(jnp.uint32), shape), rows.length
        else:
            at, extent = jax.lax.broadcasted_iota(jnp.uint32, shape, axis), shape[axis]
        index = index + at * jnp.uint32(stride % (1 << 32))
        stride *= extent
    return index


def threefry_words(rng: jax.Array):
    """The two uint32 key words of a threefry dropout rng (typed or raw), or None for another generator."""
    raw = jax.random.key_data(rng) if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng
    return raw if raw.shape == (2,) else None


def threshold16(keep_prob: float) -> int:
    """The 16-bit threshold t = round(keep_prob·2¹⁶): a 16-bit uniform u is kept when u < t (P(keep) = t/2¹⁶)."""
    return int(round(keep_prob * 65536))


def threefry2x32_primitive(k0: jax.Array, k1: jax.Array, x0: jax.Array, x1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """JAX's `threefry2x32_p` on key (k0, k1) and counters (x0, x1): the words `kernels.threefry.threefry2x32`
    writes out, through the primitive and its platform's lowering (a rolled while loop on XLA:CPU)."""
    return tuple(threefry2x32_p.bind(k0, k1, x0, x1))


def _hash_words(rng: jax.Array, counter_shape: tuple[int, ...], rows: Optional[Rows] = None
                ) -> tuple[jax.Array, jax.Array]:
    """The two uint32 words of each of keep_mask16's hashes, `counter_shape` (the mask's leading axes, then q; with
    `rows`, those rows of the full shape's hashes).

    On XLA:CPU the threefry hash is `kernels.threefry.threefry2x32`, its 20 rounds written out as uint32
    operations: the same words bit for bit as JAX's `threefry2x32_p`, whose CPU lowering is a rolled while loop
    (its outputs copied out of the loop). The step ran 1.5% faster that way (benchmarks/RESULTS.md, "Levers of
    session 28"). Other platforms keep the primitive and its own kernels."""
    raw = threefry_words(rng)
    if raw is not None:               # a threefry key: both 32-bit words of each hash are used
        # chosen by the platform the step is lowered for (a CUDA lowering traced on a CPU host keeps the primitive)
        return tuple(jax.lax.platform_dependent(raw[0], raw[1], _counters(counter_shape, rows),
                                                jnp.zeros(counter_shape, jnp.uint32), cpu=threefry2x32,
                                                default=threefry2x32_primitive))
    # rbg / unsafe_rbg (4-word keys): their own bit generator, two words per slot (rows: drawn in full, then taken)
    if rows is None:
        return tuple(jax.random.bits(rng, (2,) + counter_shape, jnp.uint32))
    words = jax.random.bits(rng, (2,) + rows.full(counter_shape), jnp.uint32)
    return tuple(take_rows(w, rows) for w in words)


def hashes16(shape: tuple[int, ...]) -> int:
    """How many threefry hashes keep_mask16 makes for a mask of `shape`: one per four elements of the last axis."""
    return math.prod(shape[:-1]) * -(-shape[-1] // 4)


def check_hashes16(shape: tuple[int, ...]) -> None:
    """Refuse a mask whose hashes' 32-bit counters would wrap (`MAX_HASHES16`): two of its blocks would repeat one
    mask. `model.validate_training` refuses such a run's settings before any compute; this guards every call."""
    if hashes16(shape) > MAX_HASHES16:
        raise ValueError(f"a 16-bit dropout mask of shape {tuple(shape)} needs {hashes16(shape)} hashes, past the "
                         f"{MAX_HASHES16} its 32-bit counters number apart; use model.dropout_bits=32")


def _quarter_keeps(rng: jax.Array, shape: tuple[int, ...], keep_prob: float, rows: Optional[Rows] = None
                   ) -> tuple[list[jax.Array], int]:
    """The four boolean shape[:-1] + (q,) masks of keep_mask16's hashes, q = ceil(L/4), in quarter order t = 0..3
    (the low and high halves of the first word, then of the second), and q. Quarter t's element (…, c) is the mask
    at (…, c + t·q). `rows`: `shape` holds those rows of the full shape's mask (not along the last axis)."""
    if rows is not None and rows.axis == len(shape) - 1:
        raise ValueError("dropout rows cannot be taken along a 16-bit mask's last axis (its hashes' quarters)")
    check_hashes16(shape if rows is None else rows.full(shape))
    threshold = threshold16(keep_prob)
    quarter = -(-shape[-1] // 4)
    words = _hash_words(rng, shape[:-1] + (quarter,), rows)
    return [((w >> shift) & 0xFFFF) < threshold for w in words for shift in (0, 16)], quarter


def keep_mask16(rng: jax.Array, shape: tuple[int, ...], keep_prob: float, rows: Optional[Rows] = None
                ) -> tuple[jax.Array, float]:
    """Boolean `shape` mask with P(True) = round(keep_prob·2¹⁶)/2¹⁶, and that probability.

    One threefry2x32 hash per 4 elements: for the last axis of length L and q = ceil(L/4), hash (…, j) gives
    elements (…, j), (…, j+q), (…, j+2q), (…, j+3q) from the low and high halves of its two words. The hashes'
    counters have the mask's leading axes, so a mask sharded over the batch is made shard by shard (no device
    computes another's bits). Counters are unique for up to 2³² hashes per call. `rows` (`Rows`): `shape` is those
    rows of a full shape, and the mask is those rows of the full shape's mask (the hashes of those rows only)."""
    out_shape, shape = tuple(shape), tuple(shape) or (1,)
    quarters, quarter = _quarter_keeps(rng, shape, keep_prob, rows)
    # compared before they are put side by side: the four quarters are stacked as booleans (1 byte per element,
    # not the 4 of the uint32 halves) and (…, 4, q) -> (…, 4q) is a free reshape; same masks, 1.03x faster step
    keep = jnp.stack(quarters, axis=-2)
    return (keep.reshape(shape[:-1] + (4 * quarter,))[..., :shape[-1]].reshape(out_shape),
            threshold16(keep_prob) / 65536)


def keep_bits16(rng: jax.Array, shape: tuple[int, ...], keep_prob: float) -> jax.Array:
    """keep_mask16(rng, shape, keep_prob)'s mask packed by hash: int8 of shape[:-1] + (q,), q = ceil(L/4), whose
    bit t (t = 0..3) of element (…, c) is the mask at (…, c + t·q) — the four masks one hash gives, a quarter of
    the bytes (what `kernels/flash.py` reads tile by tile; bits past L are padding)."""
    quarters, _ = _quarter_keeps(rng, tuple(shape) or (1,), keep_prob)
    bits = [keep.astype(jnp.uint8) << jnp.uint8(t) for t, keep in enumerate(quarters)]
    return (bits[0] | bits[1] | bits[2] | bits[3]).astype(jnp.int8)


def apply_mask16(inputs: jax.Array, rng: jax.Array, rate: float, rows: Optional[Rows] = None) -> jax.Array:
    """`inputs` with keep_mask16(rng, inputs.shape, 1 − rate, rows) applied, the kept values scaled by 2¹⁶/t. The
    product is taken in float32 and rounded once: a bfloat16 scale, 2¹⁶/58982 rounded to 1.109375 at rate 0.1,
    would shrink every kept value by 0.16% (E[y] = 0.9984·x)."""
    keep, p = keep_mask16(rng, inputs.shape, 1.0 - rate, rows)
    scaled = (inputs.astype(jnp.float32) * jnp.float32(1.0 / p)).astype(inputs.dtype)
    return jnp.where(keep, scaled, jnp.zeros((), inputs.dtype))


class Dropout16(nn.Module):
    """Dropout with 16-bit masks (module docstring); same call signature as `nn.Dropout`. `key()` draws the rng
    that `__call__` would draw instead (the same one: one draw per module and pass), for a kernel that makes the
    same mask itself (`kernels/flash.py`)."""
    rate: float
    rng_collection: str = "dropout"

    @nn.compact
    def __call__(self, inputs: jax.Array, deterministic: bool, rows: Optional[Rows] = None) -> jax.Array:
        if deterministic or self.rate == 0.0:
            return inputs
        return apply_mask16(inputs, self.make_rng(self.rng_collection), self.rate, rows)

    def key(self) -> jax.Array:
        return self.make_rng(self.rng_collection)


class Dropout(nn.Dropout):
    """`flax.linen.Dropout`'s masks (the same rng draw and bits: the class keeps its name, so modules keep their
    names and rng streams), with the kept values divided by keep_prob in float32 and rounded once: flax divides in
    the input's dtype, and keep_prob 0.9 in bfloat16 (0.8984375) made every kept value 0.17% large. Float32 inputs
    give flax's values bit for bit. `rows` (`Rows`): `inputs` is those rows of a full shape; flax's mask is drawn
    for the full shape and those rows are applied."""

    @nn.compact
    def __call__(self, inputs: jax.Array, deterministic: Optional[bool] = None, rng: Optional[jax.Array] = None,
                 rows: Optional[Rows] = None):
        if rows is not None and self.rate > 0.0 and not nn.merge_param("deterministic", self.deterministic,
                                                                        deterministic):
            rng = self.make_rng(self.rng_collection) if rng is None else rng
            keep = take_rows(jax.random.bernoulli(rng, p=1.0 - self.rate, shape=rows.full(inputs.shape)), rows)
            x = inputs.astype(jnp.float32)
            return jax.lax.select(keep, x / (1.0 - self.rate), jnp.zeros_like(x)).astype(inputs.dtype)
        if inputs.dtype == jnp.float32:
            return super().__call__(inputs, deterministic, rng)
        return super().__call__(inputs.astype(jnp.float32), deterministic, rng).astype(inputs.dtype)   # same mask


def make_dropout(rate: float, bits: int = 32) -> nn.Module:
    """The dropout module for `model.dropout_bits` (checked by model.validate_config)."""
    return Dropout(rate) if bits == 32 else Dropout16(rate)
