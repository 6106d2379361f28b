"""The code before (or tried) that `bench_levers.py`'s variants run in place of the current step's functions: each
gives the same values as the function it stands for (the module docstring of bench_levers.py names them)."""
from __future__ import annotations


def matmul_bwd_variant(dx_through_transpose: bool = False, dw_tn: bool = False, folded_dw: bool = False,
                       order: str = ""):
    """`projection._matmul_bwd` with one of its two products laid out another way, or (`order` 'dx,dw' or
    'dw,dx') the two products made to run one after the other in that order (the module docstring)."""
    from jax import lax  # pylint: disable=import-outside-toplevel
    from tupe_jax import projection  # pylint: disable=import-outside-toplevel

    def bwd(residuals, g):
        x, w = residuals
        if order:   # the second product's cotangent waits, through a barrier, for the first product's output
            first = 0 if order.startswith("dx") else 1
            done = projection._matmul_bwd(residuals, g)[first]  # pylint: disable=protected-access
            g, done = lax.optimization_barrier((g, done))
            other = projection._matmul_bwd(residuals, g)[1 - first]  # pylint: disable=protected-access
            return (done, other) if first == 0 else (other, done)
        d_x, d_w = projection._matmul_bwd(residuals, g)  # pylint: disable=protected-access
        if folded_dw and x.shape[1] > g.shape[1]:
            d_w = (lax.optimization_barrier(g.T) @ x).T.astype(w.dtype)
        if dx_through_transpose and w.shape[1] < w.shape[0]:
            d_x = (g @ lax.optimization_barrier(w.T)).astype(x.dtype)
        if dw_tn:
            d_w = lax.dot_general(x, g, (((0,), (0,)), ((), ()))).astype(w.dtype)
        return d_x, d_w
    return bwd


def logits_batch_loss(model, params, batch, rng, deterministic):
    """`pretrain.steps.batch_loss` before `head.tied_cross_entropy` (MLM only, as the benchmark): the full logits."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import optax  # pylint: disable=import-outside-toplevel
    from tupe_jax import head as head_lib  # pylint: disable=import-outside-toplevel
    logits = model.apply({"params": params}, batch.inputs, input_mask=batch.input_mask,
                         mlm_positions=batch.mlm_positions, deterministic=deterministic,
                         rngs={"dropout": rng})["logits"]
    labels, weights = batch.mlm_labels, batch.mlm_weights
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = head_lib.argmax_hits(jax.lax.optimization_barrier(logits), labels)
    return jnp.sum(nll * weights), {"weight": jnp.sum(weights), "correct": jnp.sum(correct * weights)}


def two_pass_hits(logits, labels):
    """`head.argmax_hits` before its one-pass form (same values): the max, then a tie check against it."""
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    top = jnp.max(logits, axis=-1)
    at_label = jnp.take_along_axis(logits, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    earlier = jnp.arange(logits.shape[-1], dtype=jnp.int32) < labels[..., None].astype(jnp.int32)
    tie_before = jnp.any((logits == top[..., None]) & earlier, axis=-1)
    return ((at_label == top) & ~tie_before).astype(jnp.float32)


def rolled_hash_words(rng, counter_shape, rows=None):
    """`dropout._hash_words` before session 28 (threefry keys only, as the benchmark's step uses): JAX's
    `threefry2x32_p`, a rolled while loop on XLA:CPU, instead of `kernels.threefry.threefry2x32` (the 20 rounds
    written out as uint32 operations); bit for bit the same words."""
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from tupe_jax import dropout as dropout_lib  # pylint: disable=import-outside-toplevel
    raw = dropout_lib.threefry_words(rng)
    counters = dropout_lib._counters(counter_shape, rows)  # pylint: disable=protected-access
    return dropout_lib.threefry2x32_primitive(raw[0], raw[1], counters, jnp.zeros(counter_shape, jnp.uint32))


def uint32_halves_mask(rng, shape, keep_prob, rows=None):
    """`dropout.keep_mask16` before it compared the halves first (same masks): uint32 halves concatenated, then
    compared."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from tupe_jax.dropout import _counters, threefry2x32_p  # pylint: disable=import-outside-toplevel
    out_shape, shape = tuple(shape), tuple(shape) or (1,)
    threshold = int(round(keep_prob * 65536))
    counter_shape = shape[:-1] + (-(-shape[-1] // 4),)
    raw = jax.random.key_data(rng) if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng
    words = threefry2x32_p.bind(raw[0], raw[1], _counters(counter_shape, rows), jnp.zeros(counter_shape, jnp.uint32))
    halves = jnp.concatenate([(w >> shift) & 0xFFFF for w in words for shift in (0, 16)], axis=-1)[..., :shape[-1]]
    return (halves < threshold).reshape(out_shape), threshold / 65536
