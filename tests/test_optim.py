"""Optimizer: weight-decay mask, schedule values, gradient-accumulation equivalence."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tupe_jax import optim


def _train(**kw):
    base = dict(steps=100, learning_rate=1e-3, warmup_steps=10, decay_steps=0, weight_decay=0.1, clip_norm=1.0,
                adam_b1=0.9, adam_b2=0.999, adam_eps=1e-6)
    base.update(kw)
    return ml_collections.ConfigDict(base)


def test_decay_mask_excludes_bias_and_layernorm(standin_model):
    boxed = standin_model().init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    params = jax.tree_util.tree_map(lambda x: x, nn.meta.unbox(boxed))
    params["LayerNorm_0"] = {"weird": jnp.ones(3)}  # anything under a LayerNorm module
    params["head_bias"] = jnp.ones(3)
    mask = optim.decay_mask(params)
    assert mask["mlp_in"]["kernel"] and mask["token_embed"] and mask["query"]["kernel"]
    assert not mask["mlp_in"]["bias"] and not mask["query"]["bias"]
    assert not mask["ln"]["scale"] and not mask["ln"]["bias"] and not mask["LayerNorm_0"]["weird"]
    assert not mask["head_bias"]
    # boxed trees give the same decisions
    boxed_mask = jax.tree_util.tree_leaves(optim.decay_mask(boxed))
    assert boxed_mask == jax.tree_util.tree_leaves(optim.decay_mask(nn.meta.unbox(boxed)))


def test_no_decay_on_bias_in_update():
    tx, _ = optim.make_optimizer(_train(learning_rate=0.1, warmup_steps=0, clip_norm=0.0))
    params = {"dense": {"kernel": jnp.ones((2,)), "bias": jnp.ones((2,))}}
    state = tx.init(params)
    zero = jax.tree_util.tree_map(jnp.zeros_like, params)
    updates, _ = tx.update(zero, state, params)
    assert float(jnp.abs(updates["dense"]["bias"]).max()) == 0.0
    np.testing.assert_allclose(updates["dense"]["kernel"], -0.1 * 0.1 * np.ones(2), rtol=1e-6)


def test_schedule_values():
    lr = optim.learning_rate_fn(_train())
    assert float(lr(0)) == 0.0
    assert float(lr(5)) == pytest.approx(5e-4)
    assert float(lr(10)) == pytest.approx(1e-3)
    assert float(lr(55)) == pytest.approx(5e-4)
    assert float(lr(100)) == pytest.approx(0.0, abs=1e-12)
    assert float(lr(150)) == pytest.approx(0.0, abs=1e-12)
    short = optim.learning_rate_fn(_train(steps=5, warmup_steps=100))  # warmup cut to the run length
    assert float(short(0)) == 0.0 and float(short(5)) == pytest.approx(1e-3)
    lr2 = optim.learning_rate_fn(_train(decay_steps=200, warmup_steps=0))
    assert float(lr2(0)) == pytest.approx(1e-3) and float(lr2(100)) == pytest.approx(5e-4)


@pytest.mark.parametrize("steps,warmup,decay", [(6, 1, 4), (100, 10, 0), (7, 0, 0), (1000, 100, 0)])
def test_schedule_is_exactly_zero_after_the_decay_under_jit(steps, warmup, decay):
    """Under jit XLA rounds 1 - count/span below 0 at the end (about -1e-11 x the peak): never a negative rate."""
    lr = jax.jit(optim.learning_rate_fn(_train(steps=steps, warmup_steps=warmup, decay_steps=decay)))
    end = decay or steps
    values = np.array([float(lr(jnp.int32(c))) for c in range(end - 2, end + 3)])
    assert values[0] > 0 and (values >= 0).all() and (values[2:] == 0).all()


def _loss_fn(params, batch, rng):
    del rng
    pred = batch["x"] @ params["w"] + params["b"]
    per_token = (pred - batch["y"]) ** 2 * batch["mask"]
    return per_token.sum(), batch["mask"].sum()


def test_accumulation_matches_full_batch():
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(8, 3)).astype(np.float32), "y": rng.normal(size=(8,)).astype(np.float32),
             "mask": (rng.random(8) > 0.3).astype(np.float32)}
    batch["mask"][:2] = 0.0  # microbatches with unequal token counts
    params = {"w": jnp.arange(3.0), "b": jnp.float32(0.5)}
    full = jax.jit(lambda p, b: optim.accumulate_gradients(_loss_fn, p, b, 1, jax.random.key(0)))(params, batch)
    acc = jax.jit(lambda p, b: optim.accumulate_gradients(_loss_fn, p, b, 4, jax.random.key(0)))(params, batch)
    np.testing.assert_allclose(full[0], acc[0], rtol=1e-6)
    for g1, g2 in zip(jax.tree_util.tree_leaves(full[1]), jax.tree_util.tree_leaves(acc[1])):
        np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-7)
    assert float(full[2]) == float(acc[2]) == batch["mask"].sum()
    # and it is NOT what averaging per-microbatch means would give
    means = [_loss_fn(params, jax.tree_util.tree_map(lambda v: v[i::4], batch), None) for i in range(4)]
    naive = np.mean([float(s) / max(float(w), 1e-9) for s, w in means])
    assert abs(naive - float(full[0])) > 1e-3


def test_optimizer_chain_first_update_with_clip():
    """The first update of clip-by-global-norm + AdamW against NumPy. warmup_steps=0, so the schedule gives the
    peak lr at step 0. Bias-corrected Adam at step 1: m̂ = g, v̂ = g², so the step is g / (|g| + eps) elementwise;
    AdamW adds wd·p where `decay_mask` applies (kernels, embeddings; not biases / LayerNorm); the update is
    -lr · (that). adam_eps = 0.1 is large on purpose: with eps ≈ 0 the step is ≈ sign(g) and would hide the clip."""
    lr, wd, clip, eps = 0.05, 0.1, 1.0, 0.1
    tx, schedule = optim.make_optimizer(_train(learning_rate=lr, warmup_steps=0, weight_decay=wd, clip_norm=clip,
                                               adam_eps=eps))
    assert float(schedule(0)) == pytest.approx(lr, rel=1e-7)
    rng = np.random.default_rng(0)
    params = {"dense": {"kernel": rng.normal(size=(3, 2)), "bias": rng.normal(size=(2,))},
              "LayerNorm_0": {"scale": rng.normal(size=(2,))}, "token_embed": rng.normal(size=(4, 2))}
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), params)
    decayed = {"dense": {"kernel": True, "bias": False}, "LayerNorm_0": {"scale": False}, "token_embed": True}
    p_np = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params)

    def expected(g):
        norm = np.sqrt(sum(float((x ** 2).sum()) for x in jax.tree_util.tree_leaves(g)))
        gc = jax.tree_util.tree_map(lambda x: x * min(1.0, clip / norm), g)
        return jax.tree_util.tree_map(lambda x, p, d: -lr * (x / (np.abs(x) + eps) + (wd * p if d else 0.0)),
                                      gc, p_np, decayed), norm

    for scale in (30.0, 0.05):  # global norm far above the clip, then below it (no clipping)
        g = jax.tree_util.tree_map(lambda x: rng.normal(size=x.shape) * scale, p_np)
        updates, _ = tx.update(jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), g), tx.init(params),
                               params)
        want, norm = expected(g)
        assert (norm > 5 * clip) if scale > 1 else (norm < clip)
        for u, w in zip(jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(np.asarray(u), w, rtol=2e-5, atol=1e-8)
        # invert the update to the gradient Adam saw: its global norm is min(norm, clip)
        seen = jax.tree_util.tree_map(lambda u, p, d: -np.asarray(u, np.float64) / lr - (wd * p if d else 0.0),
                                      updates, p_np, decayed)
        gc = jax.tree_util.tree_map(lambda a, x: np.sign(x) * eps * np.abs(a) / (1 - np.abs(a)), seen, g)
        gc_norm = np.sqrt(sum(float((x ** 2).sum()) for x in jax.tree_util.tree_leaves(gc)))
        assert gc_norm == pytest.approx(min(norm, clip), rel=1e-4)
        if scale > 1:  # the clip changes the update measurably (the unclipped step would be larger)
            unclipped = jax.tree_util.tree_map(lambda x: x / (np.abs(x) + eps), g)
            assert max(float(np.abs(-u / lr - d * wd * p - w).max()) for u, p, d, w in zip(
                map(np.asarray, jax.tree_util.tree_leaves(updates)), jax.tree_util.tree_leaves(p_np),
                jax.tree_util.tree_leaves(decayed), jax.tree_util.tree_leaves(unclipped))) > 0.1


@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
def test_dropout_key_is_deterministic_per_step_and_differs_from_threefry(impl):
    """`train.dropout_rng`: same raw step key -> same masks (exact resume holds); other step -> other masks;
    the threefry default passes the raw key through unchanged."""
    raw = jax.random.fold_in(jax.random.PRNGKey(3), 7)
    assert optim.dropout_key(raw, "threefry2x32") is raw

    def mask(key):
        return np.asarray(jax.jit(lambda k: jax.random.bernoulli(k, 0.9, (64, 64)))(key))

    key = optim.dropout_key(raw, impl)
    assert jax.random.key_impl(key) == jax.random.key_impl(jax.random.key(0, impl=impl))
    np.testing.assert_array_equal(mask(key), mask(optim.dropout_key(raw, impl)))
    assert (mask(key) != mask(optim.dropout_key(jax.random.fold_in(raw, 1), impl))).any()
    assert (mask(key) != mask(raw)).any()
    assert 0.85 < mask(key).mean() < 0.95


def test_unknown_dropout_rng_is_a_user_error():
    from tupe_jax.errors import UserError  # pylint: disable=import-outside-toplevel
    with pytest.raises(UserError, match="--config.train.dropout_rng"):
        optim.dropout_key(jax.random.PRNGKey(0), "philox")


def test_steps_past_the_decay_are_said_to_train_at_rate_0(capsys):
    """A run extended with its old schedule kept (`decay_steps` = its steps, as README advises) trained its new
    steps at learning rate 0 without a word."""
    from configs.pretrain import get_config  # pylint: disable=import-outside-toplevel
    from tupe_jax.pretrain.validate import validate  # pylint: disable=import-outside-toplevel
    config = get_config("pe=bert_a,size=tiny")
    with config.unlocked():
        config.train.steps, config.train.decay_steps, config.train.warmup_steps = 12, 9, 2
    validate(config, 8)
    assert ("warning: train.decay_steps = 9 ends the schedule before train.steps = 12: steps 10 to 12 train at "
            "learning rate 0 (the weights do not change)") in capsys.readouterr().out
    config.train.decay_steps = 12
    validate(config, 8)
    assert "learning rate 0" not in capsys.readouterr().out
