"""The tied output projection: logits against the token embedding, with a backward laid out for XLA:CPU.

    h (..., D), E (V, D)  ->  logits = h · Eᵀ (..., V)
    backward, g = ∂L/∂logits flattened to (M, V):   ∂L/∂h = g · E,   ∂L/∂E = (hᵀ · g)ᵀ

The maths of `nn.Embed.attend` (both operands cast to the compute dtype). On XLA:CPU (jaxlib 0.10, YNNPACK
matmuls) the forms XLA picks by itself are the slow ones: for ∂L/∂E it copies the (M, V) cotangent into its
transpose and runs gᵀ·h (at the benchmark's equal-work shape M = 2048, V = 8192, D = 256: a 64 MB copy before a
dot that is slower than hᵀ·g followed by a (D, V) transpose), and the forward runs a transposed-operand dot that
is slower than h · (Eᵀ materialised, V·D floats). `tied_logits` fixes those layouts with optimization barriers on
the CPU backend (benchmarks/RESULTS.md: the lever and its measured effect); other backends get the plain dot,
whose layouts their compilers already choose well. Same values up to float rounding (summation order).

    tied_logits(h, embedding, dtype) -> logits
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def _cpu_logits(h: jax.Array, embedding: jax.Array) -> jax.Array:
    """(M, D) x (V, D) -> (M, V)."""
    return h @ jax.lax.optimization_barrier(embedding.T)


def _cpu_logits_fwd(h, embedding):
    return h @ jax.lax.optimization_barrier(embedding.T), (h, embedding)


def _cpu_logits_bwd(residuals, g):
    h, embedding = residuals
    d_embedding_t = jax.lax.optimization_barrier(h.T @ g)        # (D, V): the (M, V) cotangent is not transposed
    return (g @ embedding).astype(h.dtype), d_embedding_t.T.astype(embedding.dtype)


_cpu_logits.defvjp(_cpu_logits_fwd, _cpu_logits_bwd)


def tied_logits(h: jax.Array, embedding: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """(..., D) hidden states x (V, D) embedding table -> (..., V) logits in `dtype` (module docstring)."""
    h, embedding = h.astype(dtype), embedding.astype(dtype)
    if jax.default_backend() != "cpu":
        return h @ embedding.T
    return _cpu_logits(h.reshape(-1, h.shape[-1]), embedding).reshape(*h.shape[:-1], embedding.shape[0])
