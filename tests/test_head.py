"""head.tied_logits: nn.Embed.attend's values and gradients with XLA:CPU-friendly layouts (float32 to rounding,
bfloat16 in bfloat16), for gathered (B, P, D) and full (B, L, D) hidden states.

head.tied_cross_entropy: its chunked CPU gradient form gives the loss, the hit count and the gradients of an
independent reference written from the equations (log-softmax of h·Eᵀ + b, first-index argmax), at chunk sizes
that divide the rows and that leave padding, with and without the bias, with zero weights and exact ties; the
full (M, V) logits never appear in the lowered gradient; a row-sharded batch on the 8 test devices gives the
unsharded values."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tupe_jax import head as head_lib
from tupe_jax.head import chunking, tied_cross_entropy, tied_logits


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


# ------------------------------------------------------------------------------------------------- tied_cross_entropy
def _inputs(seed, shape=(3, 7), d=16, v=40, tie_rows=2):
    """h (*shape, D), E (V, D), b (V,), labels and weights (shape); the first `tie_rows` rows of h are zero, so
    with b tied at its first entries their logits tie exactly; about a fifth of the weights are 0."""
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    h = jax.random.normal(k[0], (*shape, d)).reshape(-1, d).at[:tie_rows].set(0.0).reshape(*shape, d)
    emb = jax.random.normal(k[1], (v, d)) * 0.5
    bias = (jax.random.normal(k[2], (v,)) * 0.3).at[:3].set(1.5)      # entries 0..2 tie as the row maximum
    labels = jax.random.randint(k[3], shape, 0, v).reshape(-1).at[:tie_rows].set(jnp.array([0, 1])[:tie_rows])
    weights = (jax.random.uniform(k[4], shape) > 0.2).astype(jnp.float32) * 1.5
    return h, emb, bias, labels.reshape(shape), weights


def _reference(h, emb, bias, labels, weights):
    """Σ w·NLL and Σ w·hit from the equations: log-softmax of h·Eᵀ (+ b), argmax with the first index winning."""
    logits = jnp.einsum("...d,vd->...v", h, emb, precision="highest") + (0.0 if bias is None else bias)
    log_p = logits - jax.scipy.special.logsumexp(logits, axis=-1, keepdims=True)
    nll = -jnp.take_along_axis(log_p, labels[..., None], axis=-1)[..., 0]
    hits = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return jnp.sum(nll * weights), jnp.sum(hits * weights)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 21, 0])
@pytest.mark.parametrize("with_bias", [True, False])
def test_chunked_loss_hits_and_gradients_equal_the_reference(rows, with_bias):
    """3 × 7 = 21 rows: chunks of 1, 3 (divisors), 4 (→ 7 chunks of 3), 5 (→ 5 chunks of 5: 4 padded rows), 21
    and the default; three seeds. Loss and gradients within float32 rounding (1e-5), the hit count exactly."""
    for seed in range(3):
        h, emb, bias, labels, weights = _inputs(seed)
        bias = bias if with_bias else None

        def ours(h, emb, bias):
            return tied_cross_entropy(h, emb, bias, labels, weights, jnp.float32, rows=rows)

        def ref(h, emb, bias):
            return _reference(h, emb, bias, labels, weights)

        argnums = (0, 1, 2) if with_bias else (0, 1)
        (loss, hits), grads = jax.jit(jax.value_and_grad(ours, argnums, has_aux=True))(h, emb, bias)
        (want_loss, want_hits), want = jax.jit(jax.value_and_grad(ref, argnums, has_aux=True))(h, emb, bias)
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
        assert float(hits) == float(want_hits)
        for g, r in zip(grads, want):
            assert g.shape == r.shape and g.dtype == r.dtype
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(r))))
        value = jax.jit(ours)(h, emb, bias)       # undifferentiated: the plain form, the same numbers
        np.testing.assert_allclose(float(value[0]), float(want_loss), rtol=1e-5)
        assert float(value[1]) == float(want_hits)


def test_tied_rows_count_as_hits_only_for_the_first_maximal_index():
    """Rows 0 and 1 have logits = b exactly, whose maximum ties at entries 0, 1, 2: label 0 hits, label 1 does
    not, in the chunked gradient form as in the reference."""
    h, emb, bias, labels, weights = _inputs(0, shape=(2,), tie_rows=2)
    weights = jnp.ones((2,))
    ours = jax.value_and_grad(lambda e: tied_cross_entropy(h, e, bias, labels, weights, jnp.float32, rows=1),
                              has_aux=True)
    (_, hits), _ = jax.jit(ours)(emb)
    assert float(hits) == 1.0 == float(_reference(h, emb, bias, labels, weights)[1])


def test_chunking_covers_the_rows_and_prefers_a_divisor():
    assert chunking(2048, 8192) == (8, 256)                  # the default: CHUNK_BYTES of float32 logits
    assert chunking(320, 8192) == (2, 160)                   # the default head's 16 × 20 slots: no padding
    assert chunking(21, 40, rows=4) == (7, 3)
    assert chunking(23, 40, rows=4) == (6, 4)                # prime: 24 slots, one padded row
    assert chunking(5, 40, rows=100) == (1, 5)
    for m in range(1, 60):
        for rows in (1, 2, 3, 7, 16):
            n, size = chunking(m, 40, rows)
            assert n * size >= m and n * size - m < size and size <= 2 * rows


def test_the_full_logits_never_appear_in_the_lowered_gradient():
    """M = 64 rows, V = 96, chunks of 8: the compiled gradient holds (8, 96) logits and no (64, 96) array."""
    h, emb, bias, labels, weights = _inputs(1, shape=(4, 16), d=8, v=96)
    grad = jax.jit(jax.grad(lambda h, e, b: tied_cross_entropy(h, e, b, labels, weights, jnp.float32, rows=8)[0],
                            (0, 1, 2)))
    text = grad.lower(h, emb, bias).compile().as_text()
    assert "f32[8,96]" in text and "f32[64,96]" not in text
    plain = jax.jit(jax.grad(lambda h, e, b: _reference(h, e, b, labels, weights)[0], (0, 1, 2)))
    assert "f32[4,16,96]" in plain.lower(h, emb, bias).compile().as_text()     # the check can fail


def test_a_row_sharded_batch_gives_the_unsharded_values(monkeypatch):
    """Rows sharded over the 8 test devices (the data-parallel layout) and chunks of 4 rows: the same loss, hits
    and gradients as on one device."""
    monkeypatch.setattr(head_lib, "CHUNK_BYTES", 4 * 4 * 40)      # 4 rows of V = 40 a chunk
    h, emb, bias, labels, weights = _inputs(2, shape=(8, 6))
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data"))

    def loss(h, emb, bias, labels, weights):
        return tied_cross_entropy(h, emb, bias, labels, weights, jnp.float32)

    fn = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))
    want = fn(h, emb, bias, labels, weights)
    got = fn(*(jax.device_put(x, rows) for x in (h,)), emb, bias, jax.device_put(labels, rows),
             jax.device_put(weights, rows))
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_bfloat16_compute_gives_float32_gradients_near_the_float32_ones():
    h, emb, bias, labels, weights = _inputs(3, shape=(5, 4))
    fn = lambda dtype: jax.jit(jax.grad(  # noqa: E731
        lambda h, e, b: tied_cross_entropy(h, e, b, labels, weights, dtype, rows=6)[0], (0, 1, 2)))
    low, high = fn(jnp.bfloat16)(h, emb, bias), fn(jnp.float32)(h, emb, bias)
    for g, r in zip(low, high):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, r, atol=3e-2 * float(jnp.max(jnp.abs(r))))
