"""The tied output projection: logits against the token embedding, with XLA:CPU-friendly layouts.

    h (..., D), E (V, D)  ->  logits = h · Eᵀ (..., V)

The maths of `nn.Embed.attend` (both operands cast to the compute dtype). On XLA:CPU (jaxlib 0.10, YNNPACK
matmuls) it is a projection against a materialised Eᵀ (D, V) through `projection.matmul`, whose backward computes
∂L/∂Eᵀ = hᵀ · g without transposing the (M, V) cotangent. The layouts XLA picks by itself are the slow ones:
the forward as a transposed-operand dot, and ∂L/∂E by copying the cotangent into its transpose first (at the
benchmark's equal-work shape M = 2048, V = 8192, D = 256: a 64 MB copy). The barrier on Eᵀ keeps XLA from
folding the transpose back into the dot. Other backends get the plain dot, whose layouts their compilers already
choose well. Same values up to float rounding (summation order); benchmarks/RESULTS.md has the measured effect.

    tied_logits(h, embedding, dtype) -> logits
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from tupe_jax.projection import matmul


def tied_logits(h: jax.Array, embedding: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """(..., D) hidden states x (V, D) embedding table -> (..., V) logits in `dtype` (module docstring)."""
    h, embedding = h.astype(dtype), embedding.astype(dtype)
    if jax.default_backend() != "cpu":
        return h @ embedding.T
    logits = matmul(h.reshape(-1, h.shape[-1]), jax.lax.optimization_barrier(embedding.T))
    return logits.reshape(*h.shape[:-1], embedding.shape[0])
