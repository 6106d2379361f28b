"""`model.last_layer_rows="predicted"` (issue #18): an MLM encoder's last block computes its queries, attention
output, MLP and LayerNorms at the head's positions only (`mlm_positions`, P of the L), keys and values at all L.
Nothing downstream reads the other rows, so the loss and every gradient are those of the block at all positions
up to float32 rounding, with the same dropout masks: a mask drawn for some rows (`dropout.Rows`) is those rows of
the mask the whole sequence would get from the same key, for each mask kind (16-bit threefry, 16-bit rbg, flax's
32-bit)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import pretrain as pretrain_config
from tupe_jax import dropout as dropout_lib
from tupe_jax.errors import UserError
from tupe_jax.model import ModelConfig, Transformer, TransformerLM, init_params, validate_config
from tupe_jax.positional import SCHEMES
from tupe_jax.workdir import meta as meta_lib

B, L, P = 4, 24, 5


def positions(seed: int) -> np.ndarray:
    """(B, P) ascending masked positions inside each row's real tokens; row 1's last slot is padding (0, weight 0):
    a row computed twice."""
    rng = np.random.default_rng(seed)
    pos = np.sort(np.stack([rng.choice(np.arange(1, 17), P, replace=False) for _ in range(B)]), 1)
    pos[1, -1] = 0
    return pos.astype(np.int32)


@pytest.mark.parametrize("kind", ["threefry16", "rbg16", "flax32"])
@pytest.mark.parametrize("shape,axis", [((B, L, 8), 1), ((B, 2, L, L), 2)])
def test_a_mask_drawn_for_some_rows_is_those_rows_of_the_full_mask(kind, shape, axis):
    pos = jnp.asarray(positions(1))
    index = pos[:, :, None] if axis == 1 else pos[:, None, :, None]
    rows = dropout_lib.Rows(index, axis, L)
    key = jax.random.key(5, impl="rbg" if kind == "rbg16" else "threefry2x32")
    x = jax.random.normal(jax.random.key(2), shape)
    if kind == "flax32":
        drop = dropout_lib.Dropout(0.3)
        full = drop.apply({}, x, deterministic=False, rngs={"dropout": key})
        some = drop.apply({}, dropout_lib.take_rows(x, rows), deterministic=False, rows=rows, rngs={"dropout": key})
    else:
        full = dropout_lib.apply_mask16(x, key, 0.3)
        some = dropout_lib.apply_mask16(dropout_lib.take_rows(x, rows), key, 0.3, rows)
    want = np.asarray(dropout_lib.take_rows(full, rows))
    assert some.shape == want.shape and 0.5 < np.mean(want != 0) < 0.9     # a real mask, rate ≈ 0.3
    np.testing.assert_array_equal(np.asarray(some), want)


def test_rows_along_a_16_bit_masks_last_axis_are_refused():
    rows = dropout_lib.Rows(jnp.zeros((B, 1, 3), jnp.int32), 2, 8)
    with pytest.raises(ValueError, match="last axis"):
        dropout_lib.keep_mask16(jax.random.key(0), (B, 1, 3), 0.9, rows)


def tiny(pe: str, **kw) -> ModelConfig:
    """One block: the last (the rows path); a deeper encoder runs the others as ever."""
    return ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, mlp_dim=64, max_len=L, pe=pe,
                       **{"dropout_bits": 16, **kw})


def loss_and_grads(cfg: ModelConfig, params, seed: int, rng_impl: str):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(5, 64, (B, L)), jnp.int32)
    input_mask = jnp.asarray(np.arange(L)[None] < np.array([L, 20, 17, L])[:, None], jnp.int32)
    labels = jnp.asarray(rng.integers(0, 64, (B, P)), jnp.int32)
    weights = jnp.ones((B, P)).at[1, -1].set(0.0)
    key = jax.random.key(seed, impl=rng_impl)

    def loss(p):
        return TransformerLM(cfg).apply({"params": p}, tokens, input_mask=input_mask,
                                        mlm_positions=jnp.asarray(positions(seed)), deterministic=False,
                                        rngs={"dropout": key}, labels=labels, label_weights=weights)["nll_sum"]
    return jax.jit(jax.value_and_grad(loss))(params)


# each way a scheme reaches the last block: an input vector only (bert_a), a shared bias (t5, tupe_r, alibi), a
# q/k transform (rope, bert_ad, TUPE's concat form); each mask kind; the fused xla path
CASES = [("bert_a", {}, "rbg"), ("t5", {}, "threefry2x32"), ("tupe_r", {"dropout_bits": 32}, "threefry2x32"),
         ("rope", {}, "threefry2x32"), ("bert_ad", {}, "threefry2x32"),
         ("tupe_a", {"tupe_form": "concat"}, "threefry2x32"),
         ("alibi", {"attention_backend": "xla", "attention_dropout_rate": 0.0}, "threefry2x32")]


@pytest.mark.parametrize("pe,extra,rng_impl", CASES, ids=lambda c: str(c))
def test_the_last_block_at_the_predicted_rows_has_the_loss_and_gradients_of_all_rows(pe, extra, rng_impl):
    """Hidden and attention dropout 0.1 (bar the xla case: its fused path runs without attention dropout), padded
    keys and a padding slot. Loss to 1e-6; each gradient leaf within 1e-5 of its largest entry, plus 1e-9 for
    gradients that are zero but for rounding (a key bias's, to which softmax is blind: bert_ad's)."""
    everything = tiny(pe, **extra)
    params = init_params(everything, jax.random.key(3))
    seed = SCHEMES.index(pe) if pe in SCHEMES else 0
    loss_all, grads_all = loss_and_grads(everything, params, seed, rng_impl)
    loss_rows, grads_rows = loss_and_grads(dataclasses.replace(everything, last_layer_rows="predicted"), params,
                                           seed, rng_impl)
    assert np.isfinite(float(loss_all)) and float(loss_all) > 1.0
    np.testing.assert_allclose(float(loss_rows), float(loss_all), rtol=1e-6)
    last = grads_all["encoder"]["blocks_0"]
    assert all(float(jnp.abs(g).max()) > 1e-4 for g in jax.tree_util.tree_leaves(last))   # the block trains
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(grads_all), jax.tree_util.tree_leaves(grads_rows)):
        x, y = np.asarray(x), np.asarray(y)
        assert np.abs(y - x).max() <= 1e-5 * np.abs(x).max() + 1e-9, jax.tree_util.keystr(path)


def test_with_the_cudnn_backend_the_predicted_rows_take_xlas_fused_path():
    """cuDNN's kernel refuses an odd number of query rows with a bias in training; those rows go to xla's instead
    (on this CPU cuDNN's path cannot run at all, so the loss is there only if it did not)."""
    cfg = tiny("t5", attention_dropout_rate=0.0, attention_backend="xla")
    params = init_params(cfg, jax.random.key(8))
    want, _ = loss_and_grads(cfg, params, 2, "threefry2x32")
    got, _ = loss_and_grads(dataclasses.replace(cfg, attention_backend="cudnn", last_layer_rows="predicted"), params,
                            2, "threefry2x32")
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)


def test_the_encoder_with_last_rows_outputs_those_rows_of_its_full_output():
    cfg = tiny("tupe_r")
    params = init_params(cfg, jax.random.key(4))["encoder"]
    tokens = jax.random.randint(jax.random.key(1), (B, L), 5, 64)
    pos = jnp.asarray(positions(2))
    full, some = jax.jit(lambda p: (Transformer(cfg).apply({"params": p}, tokens)[0],
                                    Transformer(cfg).apply({"params": p}, tokens, last_rows=pos)[0]))(params)
    assert some.shape == (B, P, 32)
    np.testing.assert_allclose(np.asarray(some), np.asarray(jnp.take_along_axis(full, pos[..., None], 1)),
                               atol=1e-6)


def test_the_key_is_checked_new_runs_take_predicted_and_older_runs_read_all():
    config = pretrain_config.get_config("pe=tupe_r,size=tiny")
    assert config.model.last_layer_rows == "predicted"
    with config.unlocked():
        config.model.last_layer_rows = "some"
    with pytest.raises(UserError, match="unknown model.last_layer_rows 'some'") as err:
        validate_config(config.model)
    assert "--config.model.last_layer_rows" in str(err.value) and "all|predicted" in str(err.value)
    # a run made before the key computed every row; the key may change on resume (same maths) and is not part of
    # what a run is (its identity hash)
    assert meta_lib.with_added_defaults({"model.pe": "tupe_r"})["model.last_layer_rows"] == "all"
    assert meta_lib.resumable("model.last_layer_rows")
    with config.unlocked():
        config.model.last_layer_rows = "all"
    before = meta_lib.identity_hash(config)
    with config.unlocked():
        config.model.last_layer_rows = "predicted"
    assert meta_lib.identity_hash(config) == before


def test_a_causal_decoder_refuses_last_rows():
    """A decoder predicts every position: rows there would be a caller's mistake, not silently ignored."""
    cfg = dataclasses.replace(tiny("rope"), objective="clm", untie_cls=False)
    tokens = jnp.zeros((B, L), jnp.int32)
    params = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), tokens))
    with pytest.raises(ValueError, match="a causal decoder predicts every position"):
        jax.eval_shape(lambda p: Transformer(cfg).apply(p, tokens, last_rows=jnp.asarray(positions(0))), params)
