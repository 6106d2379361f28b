"""Whole-model properties of every scheme: invariances, table limits, fwd/bwd in both dtypes, the heads and the
classifier (TUPE's and BERT-Ad's positional terms: test_model_tupe.py)."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tupe_jax.errors import UserError
from tupe_jax.model import SequenceClassifier, TransformerLM, init_params
from tupe_jax.positional import SCHEMES, TABLE_SCHEMES
from tests.model_fixtures import TINY, run, tiny, tokens


# ------------------------------------------------------------------------------------------ invariances
def test_bidirectional_nopos_is_permutation_equivariant():
    cfg = tiny("nopos", "mlm")
    params = init_params(cfg, jax.random.key(0))
    x = tokens()
    perm = np.random.default_rng(0).permutation(x.shape[1])
    out = run(cfg, params, x)["logits"]
    out_perm = run(cfg, params, x[:, perm])["logits"]
    np.testing.assert_allclose(np.asarray(out)[:, perm], np.asarray(out_perm), atol=1e-5)


def test_causal_nopos_is_not_permutation_equivariant():
    cfg = tiny("nopos", "clm")
    params = init_params(cfg, jax.random.key(0))
    x = tokens()
    perm = np.random.default_rng(0).permutation(x.shape[1])
    out = run(cfg, params, x)["logits"]
    out_perm = run(cfg, params, x[:, perm])["logits"]
    assert np.abs(np.asarray(out)[:, perm] - np.asarray(out_perm)).max() > 1e-3


@pytest.mark.parametrize("pe", ["t5", "alibi", "rope"])
@pytest.mark.parametrize("objective", ["mlm", "clm"])
def test_relative_schemes_are_shift_invariant(pe, objective):
    cfg = tiny(pe, objective)
    params = init_params(cfg, jax.random.key(1))
    x = tokens()
    a = run(cfg, params, x, return_attention=True)
    b = run(cfg, params, x, position_offset=37, return_attention=True)
    for pa, pb in zip(a["attentions"], b["attentions"]):
        np.testing.assert_allclose(np.asarray(pa), np.asarray(pb), atol=1e-5)
    np.testing.assert_allclose(np.asarray(a["logits"]), np.asarray(b["logits"]), atol=1e-4)


def test_absolute_schemes_are_not_shift_invariant():
    cfg = tiny("sinusoidal", "clm")
    params = init_params(cfg, jax.random.key(1))
    a, b = run(cfg, params, tokens())["logits"], run(cfg, params, tokens(), position_offset=5)["logits"]
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-4


# ------------------------------------------------------------------------------------------ learned tables
@pytest.mark.parametrize("pe", TABLE_SCHEMES)
def test_learned_tables_refuse_long_inputs(pe):
    cfg = tiny(pe)
    params = init_params(cfg, jax.random.key(0))
    n = TINY["max_len"]   # the same words for every table (it named bert_r's 'bert_a', TUPE's 'tupe' with n rows)
    with pytest.raises(UserError, match=rf"^error: input needs {n + 1} positions but the learned position table "
                                        rf"covers {n} \(model\.max_len\), model\.max_len"):
        run(cfg, params, tokens(length=n + 1))


@pytest.mark.parametrize("pe", sorted(set(SCHEMES) - set(TABLE_SCHEMES)))
def test_table_free_schemes_accept_any_length(pe):
    cfg = tiny(pe, "clm")
    params = init_params(cfg, jax.random.key(0))
    out = run(cfg, params, tokens(length=3 * TINY["max_len"]))["logits"]
    assert out.shape == (2, 3 * TINY["max_len"], TINY["vocab_size"]) and bool(jnp.all(jnp.isfinite(out)))


# ------------------------------------------------------------------------------------------ all schemes
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("objective", ["mlm", "clm"])
@pytest.mark.parametrize("pe", SCHEMES)
def test_forward_backward_finite(pe, objective, dtype):
    cfg = tiny(pe, objective, dtype=dtype, num_layers=1)
    params = init_params(cfg, jax.random.key(0))
    x = tokens(length=10)
    mask = jnp.ones_like(x).at[1, 7:].set(0)

    @jax.jit
    def loss_and_grad(p, rng):
        def loss(p):
            logits = TransformerLM(cfg).apply({"params": p}, x, input_mask=mask, deterministic=False,
                                              rngs={"dropout": rng})["logits"]
            return jnp.mean(jax.nn.log_softmax(logits)[..., 0])
        return jax.value_and_grad(loss)(p)

    value, grads = loss_and_grad(params, jax.random.key(1))
    assert np.isfinite(float(value))
    leaves = jax.tree_util.tree_leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert all(g.dtype == jnp.float32 for g in leaves)  # params (and grads) stay float32


def test_mlm_gather_head_matches_dense_head():
    cfg = tiny("tupe_r")
    params = init_params(cfg, jax.random.key(9))
    x = tokens()
    positions = jnp.asarray([[1, 4, 0], [2, 3, 11]])
    dense = run(cfg, params, x)["logits"]
    gathered = run(cfg, params, x, mlm_positions=positions)["logits"]
    np.testing.assert_allclose(np.asarray(gathered), np.take_along_axis(np.asarray(dense), positions[..., None], 1),
                               atol=1e-5)


def test_padding_does_not_change_real_tokens():
    cfg = tiny("tupe_r")
    params = init_params(cfg, jax.random.key(10))
    x = tokens(batch=1, length=8)
    padded = jnp.concatenate([x, jnp.zeros((1, 4), jnp.int32)], axis=1)
    mask = jnp.concatenate([jnp.ones((1, 8), jnp.int32), jnp.zeros((1, 4), jnp.int32)], axis=1)
    a = run(cfg, params, x)["logits"]
    b = run(cfg, params, padded, input_mask=mask)["logits"][:, :8]
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_classifier_shares_encoder_params_with_lm():
    cfg = tiny("tupe_a")
    lm_params = init_params(cfg, jax.random.key(0))
    clf = nn.meta.unbox(SequenceClassifier(cfg, 3).init({"params": jax.random.key(1)}, tokens())["params"])
    assert jax.tree_util.tree_structure(clf["encoder"]) == jax.tree_util.tree_structure(lm_params["encoder"])
    logits = SequenceClassifier(cfg, 3).apply({"params": {**clf, "encoder": lm_params["encoder"]}}, tokens())
    assert logits.shape == (2, 3)


def test_segment_embeddings_are_optional_rows_added_to_the_input():
    """type_vocab_size 0: no parameter; 2: a (2, d) table whose row segments[b, i] joins the input (row 0 where no
    segments are given); 1: one row for every token. A negative size is refused."""
    import ml_collections  # pylint: disable=import-outside-toplevel
    from tupe_jax.model import validate_config  # pylint: disable=import-outside-toplevel
    toks = tokens()
    assert "token_type" not in init_params(tiny("bert_a"), jax.random.key(0))["encoder"]
    for size in (1, 2):
        cfg = tiny("bert_a", type_vocab_size=size, dropout_rate=0.0, attention_dropout_rate=0.0)
        params = init_params(cfg, jax.random.key(0))
        assert params["encoder"]["token_type"]["embedding"].shape == (size, TINY["hidden_size"])
        segments = (jnp.arange(toks.shape[1])[None, :] >= 5).astype(jnp.int32) * jnp.ones_like(toks)
        plain, zeros, pairs = (run(cfg, params, toks, **kw)["logits"] for kw in (
            {}, {"segments": jnp.zeros_like(toks)}, {"segments": segments}))
        np.testing.assert_array_equal(plain, zeros)
        moved = np.abs(np.asarray(pairs) - np.asarray(plain)).max(axis=-1)
        assert (moved[:, 5:] > 1e-4).all() if size == 2 else not moved.any()
    config = ml_collections.ConfigDict({**dataclasses.asdict(tiny("bert_a")), "type_vocab_size": -1})
    with pytest.raises(UserError, match="model.type_vocab_size"):
        validate_config(config)


def test_unknown_scheme_is_a_user_error():
    with pytest.raises(UserError, match="unknown positional scheme 'nope'.*model.pe"):
        init_params(dataclasses.replace(tiny("nopos"), pe="nope"), jax.random.key(0))


def test_gelu_is_the_exact_erf_gelu_in_one_form():
    """`activations.gelu` against x·Φ(x) in float64 (Φ by math.erfc, accurate in both tails) at the float32 grid
    points of [−12, 12]: within 1.1e-6 absolute (an ulp of |x| near 12; tanh's approximation is ~4e-4 off and
    fails it), jax.nn.gelu's erfc form within the same 1.1e-6 of it, and its gradient Φ(x) + x·φ(x) within 1e-6."""
    import math  # pylint: disable=import-outside-toplevel
    from tupe_jax.activations import gelu  # pylint: disable=import-outside-toplevel
    x32 = jnp.linspace(-12.0, 12.0, 240_001, dtype=jnp.float32)
    x = np.asarray(x32, np.float64)
    cdf = np.array([0.5 * math.erfc(-v / math.sqrt(2.0)) for v in x])
    exact, slope = x * cdf, cdf + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    ours = np.asarray(jax.jit(gelu)(x32), np.float64)
    assert np.abs(ours - exact).max() <= 1.1e-6
    erfc_form = np.asarray(jax.jit(lambda v: jax.nn.gelu(v, approximate=False))(x32), np.float64)
    assert np.abs(erfc_form - ours).max() <= 1.1e-6
    assert np.abs(np.asarray(jax.nn.gelu(x32, approximate=True), np.float64) - exact).max() > 1e-4
    grad = np.asarray(jax.jit(jax.vmap(jax.grad(gelu)))(x32), np.float64)
    assert np.abs(grad - slope).max() <= 1e-6
    assert gelu(jnp.ones((2,), jnp.bfloat16)).dtype == jnp.bfloat16
