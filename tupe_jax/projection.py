"""Dense projections with a backward laid out for XLA:CPU (the `dot_general` the model's Dense layers use).

    x (..., K) contracted over its trailing axes with W (K..., F...)  ->  y = x · W   (..., F...)
    backward, flattened to x (M, K), W (K, F), g = ∂L/∂y (M, F):   ∂L/∂x = g · Wᵀ,   ∂L/∂W = xᵀ · g

The weight gradient contracts the long M = batch·length axis of both operands. On XLA:CPU (jaxlib 0.10) XLA lays
that dot out by copying one operand into its transpose first, and at the benchmark's shape it picks the larger
one: for the MLP input projection (K 256, F 1024) it copies the (M, 1024) cotangent. `dense_dot_general`
materialises the transpose of the smaller operand instead (xᵀ (K, M) and xᵀ·g when K ≤ F; otherwise gᵀ (F, M)
and (gᵀ·x)ᵀ, the (F, K) result transposed back), with optimization barriers so that XLA does not fold the
transposes away again. The (F, K) product is barriered too: folded into its transpose it became a dot contracting
dim 0 of x and dim 1 of gᵀ, which XLA:CPU hands to Eigen (asynchronously) rather than YNNPACK. Other backends,
batch dimensions, other contractions, an explicit precision and a kernel with several feature axes under tensor
parallelism (QKV's (3, heads, kv): flattened, its split heads axis would be gathered) get `lax.dot_general`.
Same values up to float rounding (summation order); benchmarks/RESULTS.md has the measured effect.

    matmul(x, w) -> x · w                  (M, K) x (K, F) with the backward above (also head.tied_logits')
    dense_dot_general(x, kernel, dimension_numbers, precision=None, preferred_element_type=None) -> y
"""
from __future__ import annotations

import math

import jax
from jax import lax

from tupe_jax import sharding


@jax.custom_vjp
def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """(M, K) x (K, F) -> (M, F)."""
    return x @ w


def _matmul_fwd(x, w):
    return x @ w, (x, w)


def _matmul_bwd(residuals, g):
    x, w = residuals
    if x.shape[1] <= g.shape[1]:
        d_w = lax.optimization_barrier(x.T) @ g
    else:   # barriered: folded into the transpose, the product becomes a dot XLA:CPU runs on Eigen
        d_w = lax.optimization_barrier(lax.optimization_barrier(g.T) @ x).T
    return (g @ w.T).astype(x.dtype), d_w.astype(w.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def dense_dot_general(x, kernel, dimension_numbers, precision=None, preferred_element_type=None):
    """`lax.dot_general` for a Dense layer's (trailing x axes) · (leading kernel axes) contraction."""
    (x_axes, k_axes), (x_batch, k_batch) = dimension_numbers
    n = len(x_axes)
    plain = (jax.default_backend() != "cpu" or x_batch or k_batch or precision is not None
             or (kernel.ndim - n > 1 and sharding.tensor_parallel())   # flattened, (3, heads, kv) loses heads' split
             or tuple(x_axes) != tuple(range(x.ndim - n, x.ndim)) or tuple(k_axes) != tuple(range(n))
             or preferred_element_type is not None)
    if plain:
        return lax.dot_general(x, kernel, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type)
    lead, features = x.shape[:x.ndim - n], kernel.shape[n:]
    k, f = math.prod(kernel.shape[:n]), math.prod(features)
    y = matmul(x.reshape(math.prod(lead), k), kernel.reshape(k, f))
    return y.reshape(*lead, *features)
