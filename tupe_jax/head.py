"""The tied output projection and its loss: logits against the token embedding, with XLA:CPU-friendly layouts.

    h (..., D), E (V, D)  ->  logits = h · Eᵀ (..., V)
    z = logits (+ b),  NLL = logsumexp(z) − z[label],  hit = (argmax z == label)

`tied_logits` is the maths of `nn.Embed.attend` (both operands cast to the compute dtype). On XLA:CPU (jaxlib
0.10, YNNPACK matmuls) it is a projection against a materialised Eᵀ (D, V) through `projection.matmul`, whose
backward computes ∂L/∂Eᵀ = hᵀ · g without transposing the (M, V) cotangent. The layouts XLA picks by itself are the
slow ones: the forward as a transposed-operand dot, and ∂L/∂E by copying the cotangent into its transpose first
(at the benchmark's equal-work shape M = 2048, V = 8192, D = 256: a 64 MB copy). The barrier on Eᵀ keeps XLA from
folding the transpose back into the dot. Other backends get the plain dot, whose layouts their compilers already
choose well. Same values up to float rounding (summation order); benchmarks/RESULTS.md has the measured effect.

`tied_cross_entropy` is the loss and the accuracy count on those logits. Differentiated on XLA:CPU, its forward
walks the M rows in chunks of `rows` and gives each chunk's gradient at once, while the chunk's (rows, V) logits
are still in cache:

    ∂/∂z  Σ w·NLL = w · (softmax(z) − onehot(label))        (rows, V), never stored
    ∂/∂h = (∂/∂z) · E,   ∂/∂Eᵀ += hᵀ · (∂/∂z),   ∂/∂b += 1ᵀ · (∂/∂z)

and the backward only scales them by the loss's cotangent. ∂/∂Eᵀ takes each chunk of hᵀ from one transpose of h
made before the loop: a plain product. As the transposed-operand product hcᵀ · (∂/∂z) the head alone took 1.24×
the time on an AVX2 Zen 3 with XLA's dots; with oneDNN's both took the same (benchmarks/RESULTS.md, session 49).
The full (M, V) logits never exist, where the plain form writes and reads them (64 MB at the equal-work shape) once
per elementwise pass: the bias add, the softmax's max and exponentials, the accuracy's compare, the cotangent and
the bias gradient's reduce. The matmul FLOPs are the same. Undifferentiated (evaluation), for logits that fit in
two chunks, and on other backends, it is the plain form: `tied_logits`,
`optax.softmax_cross_entropy_with_integer_labels` and `argmax_hits`.

    tied_logits(h, embedding, dtype) -> logits
    argmax_hits(logits, labels) -> float32 hits (argmax == label, first index winning ties)
    tied_cross_entropy(h, embedding, bias, labels, weights, dtype, rows=0) -> (Σ w·NLL, Σ w·hit)
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import optax

from tupe_jax.projection import matmul

# The default chunk: this many bytes of float32 logits (256 rows at V = 8192). In the head-only A/B on a Zen 4 CPU
# (benchmarks/bench_head.py, results_head_chunks.json) chunks of 256 rows beat 128 and 512 at 2048 rows, and at 320
# rows (10 MiB of logits) no chunking beat the plain form: below two chunks' worth of logits the plain form runs.
CHUNK_BYTES = 8 << 20


def tied_logits(h: jax.Array, embedding: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """(..., D) hidden states x (V, D) embedding table -> (..., V) logits in `dtype` (module docstring)."""
    h, embedding = h.astype(dtype), embedding.astype(dtype)
    if jax.default_backend() != "cpu":
        return h @ embedding.T
    logits = matmul(h.reshape(-1, h.shape[-1]), jax.lax.optimization_barrier(embedding.T))
    return logits.reshape(*h.shape[:-1], embedding.shape[0])


def argmax_hits(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """float32 (argmax(logits, -1) == labels), first index winning ties, as `jnp.argmax`.

    label = argmax  ⇔  no j < label has logits[j] ≥ logits[label]  and  no j > label has logits[j] > logits[label]:
    one compare against the label's logit and one boolean reduce, a single pass over the (…, vocab) logits. Same
    values as the argmax form, ±inf included; a NaN at the label is no hit (NaN weights scored 1.0). XLA:CPU
    lowers argmax to a variadic (value, index) reduce several times slower (the step with the head on all 128
    positions ran 1.074× longer, benchmarks/results_levers_cpu.json), and the form before this one (a max, then
    a tie check against it: two passes) ran 1.02× longer (benchmarks/results_levers_accuracy_*.json).
    """
    label = labels[..., None].astype(jnp.int32)
    at_label = jnp.take_along_axis(logits, label, axis=-1)
    index = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    beaten = jnp.where(index < label, logits >= at_label, logits > at_label)
    return (~jnp.any(beaten, axis=-1) & ~jnp.isnan(at_label[..., 0])).astype(jnp.float32)


def tied_cross_entropy(h: jax.Array, embedding: jax.Array, bias: Optional[jax.Array], labels: jax.Array,
                       weights: jax.Array, dtype: jnp.dtype, rows: int = 0) -> tuple[jax.Array, jax.Array]:
    """h (..., D), E (V, D), b (V,) or None, labels and weights (...) -> (Σ w·NLL, Σ w·hit), float32 scalars.

    `rows`: rows per chunk of the CPU gradient form; 0: `CHUNK_BYTES` of logits a chunk, and the plain form when
    all the logits fit in two chunks (module docstring)."""
    h, embedding = h.astype(dtype), embedding.astype(dtype)
    d, v = h.shape[-1], embedding.shape[0]
    m = h.size // d
    if jax.default_backend() != "cpu" or m == 0 or (rows <= 0 and m <= 2 * default_rows(v)):
        return _plain(h, embedding, bias, labels, weights)
    has_bias = bias is not None
    bias = jnp.zeros((v,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    n, size = chunking(m, v, rows)
    return _chunked(n, size, has_bias, h.reshape(m, d), embedding, bias, labels.reshape(m).astype(jnp.int32),
                    weights.reshape(m).astype(jnp.float32))


def default_rows(v: int) -> int:
    """Rows of a default chunk: `CHUNK_BYTES` of float32 logits over a vocabulary of v."""
    return max(1, CHUNK_BYTES // (4 * v))


def chunking(m: int, v: int, rows: int = 0) -> tuple[int, int]:
    """(chunks, rows per chunk) covering m rows: about `rows` (0: `default_rows(v)`) rows each, a divisor of m
    where one is near (within 2×), else the last chunk padded with weight-0 rows."""
    want = min(m, rows if rows > 0 else default_rows(v))
    n = -(-m // want)
    for k in range(n, min(2 * n, m) + 1):
        if m % k == 0:
            return k, m // k
    return n, -(-m // n)


def _plain(h, embedding, bias, labels, weights):
    """The reference form: full logits, optax's cross entropy, `argmax_hits`. The barrier before the accuracy:
    without it XLA re-fuses the loss around that pass, slower, and the loss's float32 value moves by an ulp
    (tests/test_behaviour.py)."""
    logits = tied_logits(h, embedding, embedding.dtype).astype(jnp.float32)
    if bias is not None:
        logits = logits + bias
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    hits = argmax_hits(jax.lax.optimization_barrier(logits), labels)
    return jnp.sum(nll * weights), jnp.sum(hits * weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _chunked(n, size, has_bias, h, embedding, bias, labels, weights):
    return _plain(h, embedding, bias if has_bias else None, labels, weights)


def _chunked_fwd(n, size, has_bias, h, embedding, bias, labels, weights):
    m, d = h.shape
    v = embedding.shape[0]
    pad = n * size - m
    if pad:
        h = jnp.pad(h, ((0, pad), (0, 0)))
        labels, weights = jnp.pad(labels, (0, pad)), jnp.pad(weights, (0, pad))
    # chunk j holds rows j, j + n, j + 2n, ...: a row-sharded batch stays sharded within each chunk
    strided = lambda x: jnp.swapaxes(x.reshape(size, n, *x.shape[1:]), 0, 1)  # noqa: E731
    e_t = jax.lax.optimization_barrier(embedding.T)
    index = jnp.arange(v, dtype=jnp.int32)

    def chunk(carry, xs):
        d_et, d_b = carry
        hc, hct, lc, wc = xs
        z = (hc @ e_t).astype(jnp.float32) + (bias if has_bias else 0.0)
        top = jnp.max(z, axis=-1, keepdims=True)
        e = jnp.exp(z - top)
        total = jnp.sum(e, axis=-1)
        at_label = jnp.take_along_axis(z, lc[:, None], axis=-1)[:, 0]
        nll = jnp.sum((top[:, 0] + jnp.log(total) - at_label) * wc)
        hits = jnp.sum(argmax_hits(z, lc) * wc)
        dz = e * (wc / total)[:, None] - jnp.where(index == lc[:, None], wc[:, None], 0.0)
        dh = dz.astype(embedding.dtype) @ embedding        # h and E share the compute dtype
        d_et = d_et + jnp.matmul(hct, dz.astype(hc.dtype), preferred_element_type=jnp.float32)
        if has_bias:
            d_b = d_b + jnp.sum(dz, axis=0)
        return (d_et, d_b), (nll, hits, dh)

    init = (jnp.zeros((d, v), jnp.float32), jnp.zeros((v,), jnp.float32))
    h_t = jax.lax.optimization_barrier(jnp.swapaxes(strided(h), 1, 2))   # (n, D, size): kept apart from the dot
    (d_et, d_b), (nll, hits, dh) = jax.lax.scan(chunk, init, (strided(h), h_t, strided(labels), strided(weights)))
    dh = jnp.swapaxes(dh, 0, 1).reshape(n * size, d)[:m]
    return (jnp.sum(nll), jnp.sum(hits)), (dh, d_et, d_b)


def _chunked_bwd(n, size, has_bias, residuals, cotangents):
    del n, size
    dh, d_et, d_b = residuals           # h and E share the compute dtype; b is float32
    g = cotangents[0]                   # the hit count has no gradient
    return g.astype(dh.dtype) * dh, (g * d_et).T.astype(dh.dtype), g * d_b if has_bias else None, None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)

