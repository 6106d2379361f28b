"""head.tied_logits: nn.Embed.attend's values and gradients with XLA:CPU-friendly layouts (float32 to rounding,
bfloat16 in bfloat16), for gathered (B, P, D) and full (B, L, D) hidden states."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tupe_jax.head import tied_logits


@pytest.mark.parametrize("shape", [(4, 20, 64), (2, 33, 64), (7, 64)])
def test_values_and_gradients_equal_embed_attend(shape):
    k = jax.random.split(jax.random.PRNGKey(len(shape)), 3)
    h = jax.random.normal(k[0], shape)
    emb = jax.random.normal(k[1], (1000, 64)) * 0.02
    w = jax.random.normal(k[2], shape[:-1] + (1000,))
    embed = nn.Embed(1000, 64)

    def ours(h, e):
        return jnp.sum(jnp.sin(tied_logits(h, e, jnp.float32)) * w)

    def reference(h, e):
        return jnp.sum(jnp.sin(embed.apply({"params": {"embedding": e}}, h, method=nn.Embed.attend)) * w)

    np.testing.assert_allclose(tied_logits(h, emb, jnp.float32),
                               embed.apply({"params": {"embedding": emb}}, h, method=nn.Embed.attend),
                               rtol=1e-6, atol=1e-6)
    got, want = jax.jit(jax.grad(ours, (0, 1)))(h, emb), jax.jit(jax.grad(reference, (0, 1)))(h, emb)
    for g, r in zip(got, want):
        assert g.shape == r.shape
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(r))))


def test_bfloat16_compute_gives_bfloat16_logits_and_float32_gradients():
    h = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 32))
    emb = jax.random.normal(jax.random.PRNGKey(1), (50, 32))
    logits = tied_logits(h, emb, jnp.bfloat16)
    assert logits.dtype == jnp.bfloat16 and logits.shape == (3, 5, 50)
    grads = jax.grad(lambda h, e: jnp.sum(tied_logits(h, e, jnp.bfloat16).astype(jnp.float32)), (0, 1))(h, emb)
    assert grads[0].dtype == jnp.float32 and grads[1].dtype == jnp.float32
    want = jnp.broadcast_to(jnp.sum(h.reshape(-1, 32), 0), (50, 32))     # d(sum of logits)/dE = Σ_rows h
    np.testing.assert_allclose(grads[1], want, atol=2e-2 * float(jnp.max(jnp.abs(want))))
