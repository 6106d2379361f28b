"""projection.dense_dot_general: the Dense layers' `lax.dot_general` values and gradients with XLA:CPU-friendly
weight-gradient layouts (float32 to rounding), for both transposes it picks (K ≤ F and K > F), multi-axis
contractions (the QKV and output projections) and the forms it hands back to `lax.dot_general` unchanged."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tupe_jax.projection import dense_dot_general


def _grads(module, x, w):
    def loss(fn, x, p):
        y = module.clone(dot_general=fn).apply({"params": p}, x)
        return jnp.sum(jnp.sin(y) * w)
    params = module.init(jax.random.PRNGKey(0), x)["params"]
    params = jax.tree_util.tree_map(lambda a: a + 0.1 * jax.random.normal(jax.random.PRNGKey(9), a.shape), params)
    ours = jax.jit(jax.value_and_grad(lambda x, p: loss(dense_dot_general, x, p), (0, 1)))(x, params)
    plain = jax.jit(jax.value_and_grad(lambda x, p: loss(jax.lax.dot_general, x, p), (0, 1)))(x, params)
    return ours, plain


@pytest.mark.parametrize("module,x_shape,y_shape", [
    (nn.Dense(96), (3, 17, 32), (3, 17, 96)),                                      # K < F: xᵀ materialised
    (nn.Dense(24), (3, 17, 80), (3, 17, 24)),                                      # K > F: gᵀ materialised
    (nn.DenseGeneral((3, 2, 8)), (2, 9, 32), (2, 9, 3, 2, 8)),                     # the QKV projection
    (nn.DenseGeneral(32, axis=(-2, -1)), (2, 9, 2, 8), (2, 9, 32)),                # the output projection
])
def test_values_and_gradients_equal_lax_dot_general(module, x_shape, y_shape):
    k = jax.random.split(jax.random.PRNGKey(len(x_shape) + y_shape[-1]), 2)
    x, w = jax.random.normal(k[0], x_shape), jax.random.normal(k[1], y_shape)
    (value, grads), (want_value, want_grads) = _grads(module, x, w)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves(want_grads)):
        assert got.shape == want.shape and float(jnp.abs(want).max()) > 0
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(jnp.abs(want).max()),
                                   err_msg=jax.tree_util.keystr(path))


def test_other_contractions_are_lax_dot_general_exactly():
    """Batch dimensions, a contraction not over x's trailing axes, or an explicit precision: plain dot_general."""
    a = jax.random.normal(jax.random.PRNGKey(1), (4, 5, 6))
    b = jax.random.normal(jax.random.PRNGKey(2), (4, 6, 3))
    c = jax.random.normal(jax.random.PRNGKey(3), (5, 7))
    for lhs, rhs, dims, kw in (
            (a, b, (((2,), (1,)), ((0,), (0,))), {}),
            (a, c, (((1,), (0,)), ((), ())), {}),
            (a, b[0], (((2,), (0,)), ((), ())), {"precision": jax.lax.Precision.HIGHEST})):
        np.testing.assert_array_equal(dense_dot_general(lhs, rhs, dims, **kw),
                                      jax.lax.dot_general(lhs, rhs, dims, **kw))


def test_bfloat16_inputs_give_bfloat16_outputs_and_gradients():
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 16)).astype(jnp.bfloat16)
    kernel = jax.random.normal(jax.random.PRNGKey(1), (16, 8)).astype(jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))
    y = dense_dot_general(x, kernel, dims)
    assert y.dtype == jnp.bfloat16 and y.shape == (4, 8)
    gx, gk = jax.grad(lambda x, k: jnp.sum(dense_dot_general(x, k, dims).astype(jnp.float32)), (0, 1))(x, kernel)
    assert gx.dtype == gk.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(gk, np.float32),
                               np.broadcast_to(np.asarray(x, np.float32).sum(0)[:, None], (16, 8)), rtol=2e-2)


def test_a_tall_weights_gradient_is_one_plain_dot_and_a_transpose():
    """For a weight taller than wide the weight gradient is (gᵀ·x)ᵀ. XLA folds that transpose into the dot unless a
    barrier stops it: the folded dot contracts dim 0 of x and dim 1 of gᵀ, and XLA:CPU runs it on Eigen instead of
    YNNPACK (3-4% of the benchmark's train step, benchmarks/RESULTS.md). Every dot of the compiled backward must
    contract its lhs's last axis."""
    x, kernel = jnp.ones((64, 80)), jnp.ones((80, 24))
    dims = (((1,), (0,)), ((), ()))
    grad = jax.jit(jax.grad(lambda k: jnp.sum(jnp.sin(dense_dot_general(x, k, dims)))))
    hlo = grad.lower(kernel).compile().as_text()
    contractions = re.findall(r" dot\(.*?lhs_contracting_dims=\{(\d+)\}", hlo)
    assert contractions and set(contractions) == {"1"}, contractions
