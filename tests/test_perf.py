"""Performance formulations that must not change the maths (issue #7).

1. TUPE's concat form (`model.tupe_form='concat'`: concatenated heads [xW ; pU (; θ2 dim)], no bias for the
   absolute part) gives the same attention probabilities, outputs and gradients as the bias form, and both equal
   an independent NumPy "standard attention over concatenated heads" reference at scale 1/√(2·d_h).
2. The MLM head on the masked positions only (the gather form used by `train.batch_loss`) gives the same loss
   and gradients as the dense head over every position with dense label/weight grids.
3. The fused attention backend (`model.attention_backend='xla'`) gives the einsum path's loss and gradients,
   for TUPE's bias and concat forms and for bert_a.
4. (issue #18) The fused paths keep the positional bias exact enough in bf16: float32 on `xla`, a softmax-invariant
   row-max shift before cuDNN's bf16 bias; checked against the float32 einsum path on long ALiBi and TUPE-R inputs.
5. (issue #18) The optimised train step (gather head, 1ᵀ·g bias gradient, `argmax_hits`, the chunked loss,
   fused backend, CPU projection layouts, GELU's erf form) matches a plain step in float32: loss, accuracy and
   gradients.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tupe_jax.model import ModelConfig, TransformerLM, init_params
from tupe_jax.data.batch import LMBatch
from tupe_jax.pretrain.steps import batch_loss

TINY = dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, mlp_dim=64, max_len=16,
            dropout_rate=0.0, attention_dropout_rate=0.0)
CASES = [("tupe_a", "mlm", True), ("tupe_a", "mlm", False), ("tupe_a", "clm", False), ("tupe_r", "mlm", True)]


def config(pe, objective="mlm", untie_cls=True, **kw):
    return ModelConfig(pe=pe, objective=objective, untie_cls=untie_cls, **{**TINY, **kw})


@functools.partial(jax.jit, static_argnums=0, static_argnames=("return_hidden", "return_attention"))
def run(cfg, params, toks, mask=None, **kw):
    return TransformerLM(cfg).apply({"params": params}, toks, input_mask=mask, **kw)


def inputs(length=12, seed=0):
    toks = jax.random.randint(jax.random.key(seed), (2, length), 5, TINY["vocab_size"])
    mask = jnp.ones_like(toks).at[1, length - 3:].set(0)
    return toks, mask


def layer_norm(x, scale, bias, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * scale + bias


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# ------------------------------------------------------------------------------------------ concat == bias
@pytest.mark.parametrize("pe,objective,untie_cls", CASES)
def test_concat_form_equals_bias_form(pe, objective, untie_cls):
    """Same params (the forms share parameter names), same probs / logits / hidden states to 1e-5."""
    bias_cfg = config(pe, objective, untie_cls, num_layers=2)  # the shared terms reach every layer
    concat_cfg = dataclasses.replace(bias_cfg, tupe_form="concat")
    params = init_params(bias_cfg, jax.random.key(1))
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
        init_params(concat_cfg, jax.random.key(1)))
    toks, mask = inputs()
    a = run(bias_cfg, params, toks, mask, return_attention=True, return_hidden=True)
    b = run(concat_cfg, params, toks, mask, return_attention=True, return_hidden=True)
    for pa, pb in zip(a["attentions"], b["attentions"]):
        np.testing.assert_allclose(np.asarray(pb), np.asarray(pa), atol=1e-5)
    for ha, hb in zip(a["hidden_states"], b["hidden_states"]):
        np.testing.assert_allclose(np.asarray(hb), np.asarray(ha), atol=1e-5)
    np.testing.assert_allclose(np.asarray(b["logits"]), np.asarray(a["logits"]), atol=1e-5)
    # the fused path (jax.nn.dot_product_attention, v zero-padded to the widened head dim) agrees too
    fused = run(dataclasses.replace(concat_cfg, attention_backend="xla"), params, toks, mask)
    np.testing.assert_allclose(np.asarray(fused["logits"]), np.asarray(a["logits"]), atol=1e-5)


@pytest.mark.parametrize("pe", ["tupe_a", "tupe_r"])
def test_concat_form_has_the_same_gradients(pe):
    bias_cfg = config(pe)
    concat_cfg = dataclasses.replace(bias_cfg, tupe_form="concat", attention_backend="xla")
    params = init_params(bias_cfg, jax.random.key(2))
    toks, mask = inputs(seed=3)

    def grads(cfg):
        def loss(p):
            logits = TransformerLM(cfg).apply({"params": p}, toks, input_mask=mask)["logits"]
            return jnp.mean(jax.nn.log_softmax(logits)[..., 7])
        return jax.jit(jax.grad(loss))(params)

    ga, gb = grads(bias_cfg), grads(concat_cfg)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(ga), jax.tree_util.tree_leaves(gb)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-6, rtol=1e-4,
                                   err_msg=jax.tree_util.keystr(path))
    table = np.asarray(gb["encoder"]["positional"]["proj"]["pos_table"])
    assert np.all(table[0] == 0.0)  # θ1 drops out: exactly zero gradient in the concat form as well


@pytest.mark.parametrize("pe,objective", [("tupe_a", "mlm"), ("tupe_r", "mlm"), ("tupe_r", "clm"), ("bert_a", "mlm")])
def test_xla_backend_equals_einsum_backend(pe, objective, monkeypatch):
    """`attention_backend='xla'` (jax.nn.dot_product_attention) vs the einsum path, float32 on CPU, for TUPE's
    BIAS form (the (1, H, L, L) position term goes in as the kernel's `bias`, so its gradient flows through the
    fused op) and for bert_a (no bias at all), with a padded row and, for clm, the causal mask. Same params; loss
    and every gradient leaf agree. Tolerance: both paths do the same float32 maths in a different op order
    (the kernel's grouped-head reshapes and softmax vs explicit logits), i.e. float32 rounding only: rtol 1e-6 on
    the loss, rtol 1e-5 / atol 1e-7 on gradients (measured on CPU: loss equal, gradients within 1.5e-8)."""
    einsum_cfg = config(pe, objective, num_layers=2, tupe_form="bias", attention_backend="einsum")
    xla_cfg = dataclasses.replace(einsum_cfg, attention_backend="xla")
    params = init_params(einsum_cfg, jax.random.key(8))
    toks, mask = inputs(seed=9)

    def loss_fn(cfg):
        def loss(p):
            logits = TransformerLM(cfg).apply({"params": p}, toks, input_mask=mask)["logits"]
            nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), toks[..., None], -1)[..., 0]
            return jnp.sum(nll * mask) / jnp.sum(mask)
        return loss

    calls = []  # the xla config really takes the fused path, once per layer (and the einsum one never does)
    fused = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        lambda *a, **kw: calls.append(kw.get("implementation")) or fused(*a, **kw))
    la, ga = jax.jit(jax.value_and_grad(loss_fn(einsum_cfg)))(params)
    assert calls == []
    lb, gb = jax.jit(jax.value_and_grad(loss_fn(xla_cfg)))(params)
    assert calls == ["xla"] * einsum_cfg.num_layers
    assert np.isfinite(float(la)) and float(la) > 1.0
    np.testing.assert_allclose(float(lb), float(la), rtol=1e-6)
    leaves = jax.tree_util.tree_leaves_with_path(ga)
    assert sum(float(jnp.abs(x).max()) > 0 for _, x in leaves) >= len(leaves) - 1  # real gradients, not zeros
    for (path, x), y in zip(leaves, jax.tree_util.tree_leaves(gb)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-7, rtol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("untie_cls", [True, False])
def test_tupe_a_is_standard_attention_over_concatenated_heads(untie_cls):
    """Independent NumPy reference: q' = [xW^Q ; pU^Q (; 1)], k' = [xW^K ; pU^K (; θ2·√(2d_h))] for i, j ≥ 1,
    position parts of [CLS] zeroed, standard softmax(q'k'ᵀ/√(2d_h)) — against the BIAS form's layer-0 probs."""
    cfg = config("tupe_a", untie_cls=untie_cls)
    params = init_params(cfg, jax.random.key(4))
    toks, mask = inputs(length=10, seed=5)
    out = run(cfg, params, toks, mask, return_attention=True, return_hidden=True)
    f64 = lambda v: np.asarray(v, np.float64)  # noqa: E731
    h0 = f64(out["hidden_states"][0])
    qkv = params["encoder"]["blocks_0"]["attention"]["qkv"]
    proj = np.einsum("bld,dthk->btlhk", h0, f64(qkv["kernel"])) + f64(qkv["bias"])[None, :, None]
    q, k = proj[:, 0], proj[:, 1]                                         # (B, L, H, d_h)
    pos = params["encoder"]["positional"]["proj"]
    length, heads, d_h = 10, cfg.num_heads, cfg.head_dim
    rows = layer_norm(f64(pos["pos_table"])[: length + int(untie_cls)], f64(pos["pos_ln"]["scale"]),
                      f64(pos["pos_ln"]["bias"]))
    pq = np.einsum("ld,dhk->lhk", rows, f64(pos["pos_q"]["kernel"])) + f64(pos["pos_q"]["bias"])
    pk = np.einsum("ld,dhk->lhk", rows, f64(pos["pos_k"]["kernel"])) + f64(pos["pos_k"]["bias"])
    if untie_cls:
        theta2 = np.sum(pq[1] * pk[1], -1)                                # (H,), unscaled
        pq, pk = pq[1:].copy(), pk[1:].copy()
        pq[0] = pk[0] = 0.0
        extra_q = np.ones((length, heads, 1))
        extra_q[0] = 0.0
        extra_k = np.zeros((length, heads, 1))
        extra_k[0, :, 0] = theta2
        pq, pk = np.concatenate([pq, extra_q], -1), np.concatenate([pk, extra_k], -1)
        assert pq.shape[-1] == d_h + 1                                    # one extra dimension carries θ2
    q2 = np.concatenate([q, np.broadcast_to(pq, q.shape[:2] + pq.shape[1:])], -1)
    k2 = np.concatenate([k, np.broadcast_to(pk, k.shape[:2] + pk.shape[1:])], -1)
    logits = np.einsum("bqhd,bkhd->bhqk", q2, k2) / np.sqrt(2 * d_h)
    logits = np.where(np.asarray(mask, bool)[:, None, None, :], logits, -1e30)
    np.testing.assert_allclose(np.asarray(out["attentions"][0]), softmax(logits), atol=1e-5)


# ------------------------------------------------------------------------------------------ gather head == dense head
def mlm_batch(length=12, predictions=4, seed=0):
    rng = np.random.default_rng(seed)
    toks, mask = (np.asarray(a) for a in inputs(length, seed))
    positions = np.zeros((2, predictions), np.int32)
    weights = np.zeros((2, predictions), np.float32)
    for b, real in enumerate(mask.sum(1)):
        picked = rng.choice(np.arange(1, real), size=predictions - b, replace=False)  # row 1 has one empty slot
        positions[b, : len(picked)] = picked
        weights[b, : len(picked)] = 1.0
    labels = rng.integers(5, TINY["vocab_size"], (2, predictions)).astype(np.int32) * (weights > 0)
    return LMBatch(inputs=toks, targets=None, weights=None, input_mask=mask, mlm_positions=positions,
                   mlm_labels=labels, mlm_weights=weights)


def dense_reference_loss(model, params, batch, rng, deterministic):
    """Σ weighted NLL with the head on EVERY position and (B, L) label / weight grids."""
    logits = model.apply({"params": params}, batch.inputs, input_mask=batch.input_mask,
                         deterministic=deterministic, rngs={"dropout": rng})["logits"]       # (B, L, V)
    rows = np.arange(batch.inputs.shape[0])[:, None]
    labels = jnp.zeros(batch.inputs.shape, jnp.int32).at[rows, batch.mlm_positions].add(
        batch.mlm_labels * (batch.mlm_weights > 0))
    weights = jnp.zeros(batch.inputs.shape, jnp.float32).at[rows, batch.mlm_positions].add(
        batch.mlm_weights)
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, labels) * weights)


@pytest.mark.parametrize("pe,deterministic", [("bert_a", True), ("tupe_r", False)])
def test_gather_head_matches_dense_head_loss_and_gradients(pe, deterministic):
    cfg = config(pe, dropout_rate=0.1, attention_dropout_rate=0.1)
    model = TransformerLM(cfg)
    params = init_params(cfg, jax.random.key(6))
    batch = jax.tree_util.tree_map(jnp.asarray, mlm_batch())
    rng = jax.random.key(7)
    gather_fn = jax.jit(jax.value_and_grad(lambda p: batch_loss(model, p, batch, rng, deterministic)[0]))
    dense_fn = jax.jit(jax.value_and_grad(lambda p: dense_reference_loss(model, p, batch, rng, deterministic)))
    (lg, gg), (ld, gd) = gather_fn(params), dense_fn(params)
    np.testing.assert_allclose(float(lg), float(ld), rtol=1e-6)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(gd), jax.tree_util.tree_leaves(gg)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-6, rtol=1e-4,
                                   err_msg=jax.tree_util.keystr(path))


# ------------------------------------------------------------------------------------------ shared-bias add
def test_shared_bias_add_has_the_plain_broadcast_gradients():
    """`add_shared_bias` (the bias cotangent as 1ᵀ·g, a dot instead of XLA:CPU's slow batch reduce) must give
    the value and both gradients of `logits + bias`, including through the softmax of a real loss."""
    from tupe_jax.attention import add_shared_bias  # pylint: disable=import-outside-toplevel
    logits = jax.random.normal(jax.random.key(0), (3, 2, 5, 5))
    bias = jax.random.normal(jax.random.key(1), (1, 2, 5, 5))
    target = jax.random.normal(jax.random.key(2), (3, 2, 5, 5))

    def loss(add, lg, b):
        return jnp.sum(jax.nn.softmax(add(lg, b), axis=-1) * target)

    ours = jax.jit(jax.value_and_grad(functools.partial(loss, add_shared_bias), argnums=(0, 1)))(logits, bias)
    plain = jax.jit(jax.value_and_grad(functools.partial(loss, jnp.add), argnums=(0, 1)))(logits, bias)
    np.testing.assert_allclose(float(ours[0]), float(plain[0]), rtol=1e-6)
    for x, y in zip(ours[1], plain[1]):
        assert x.shape == y.shape
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    # an independent reference for the bias gradient: the batch sum of the logits' gradient
    np.testing.assert_allclose(np.asarray(ours[1][1]), np.asarray(ours[1][0]).sum(0, keepdims=True), rtol=1e-5,
                               atol=1e-6)


# ------------------------------------------------------------------------------------------ dropout PRNG
def test_train_step_with_rbg_dropout_is_reproducible_and_keeps_the_state_format():
    """`train.dropout_rng='rbg'` changes only the dropout masks: same state + batch -> identical step, a loss
    different from threefry's, and the same raw-key state layout (checkpoints do not depend on the choice)."""
    from tupe_jax.pretrain.steps import make_train_step  # pylint: disable=import-outside-toplevel
    cfg = config("tupe_r", dropout_rate=0.1, attention_dropout_rate=0.1)
    model = TransformerLM(cfg)
    params = init_params(cfg, jax.random.key(0))
    tx = optax.adamw(1e-3)
    state = {"step": jnp.int32(0), "params": params, "opt_state": tx.init(params), "rng": jax.random.PRNGKey(1)}
    batch = jax.tree_util.tree_map(jnp.asarray, mlm_batch())
    schedule = optax.constant_schedule(1e-3)
    rbg = jax.jit(make_train_step(model, tx, schedule, 1, "rbg"))
    threefry = jax.jit(make_train_step(model, tx, schedule, 1))
    (s1, m1), (s2, m2), (s3, m3) = rbg(state, batch), rbg(state, batch), threefry(state, batch)
    assert float(m1["loss"]) == float(m2["loss"]) and np.isfinite(float(m1["loss"]))
    assert float(m1["loss"]) != float(m3["loss"])
    assert jax.tree_util.tree_structure(s1) == jax.tree_util.tree_structure(s3)
    assert s1["rng"].dtype == s3["rng"].dtype and s1["rng"].shape == s3["rng"].shape
    for x, y in zip(jax.tree_util.tree_leaves(s1["params"]), jax.tree_util.tree_leaves(s2["params"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------------------------------------ optimised == plain step
def _grads_recorder():
    """An optax transformation that applies no update and keeps the step's gradients as its state."""
    return optax.GradientTransformation(
        lambda params: jax.tree_util.tree_map(jnp.zeros_like, params),
        lambda grads, state, params=None: (jax.tree_util.tree_map(jnp.zeros_like, grads), grads))


@pytest.mark.parametrize("pe,backend,chunk_rows", [("bert_a", "einsum", 0), ("tupe_r", "einsum", 0),
                                                   ("tupe_r", "einsum", 3), ("tupe_r", "xla", 0), ("alibi", "xla", 0)])
def test_optimised_train_step_matches_the_plain_step(pe, backend, chunk_rows, monkeypatch):
    """The pretraining train step as it runs — MLM head on the gathered slots, the bias gradient as 1ᵀ·g
    (`add_shared_bias`), accuracy by `argmax_hits`, the fused attention backend when asked (float32 bias), the
    XLA:CPU layouts of the tied output projection (`head.tied_logits`) and of every Dense layer
    (`projection.dense_dot_general`), GELU's erf form (`activations.gelu`) — against a plain step written without
    any of them: head on every position with dense label/weight grids, a broadcast `logits + bias`, `jnp.argmax`
    accuracy, einsum attention, `h · Eᵀ`, `lax.dot_general` and `jax.nn.gelu`. Same params, batch and dropout
    key (hidden dropout 0.1; attention dropout 0 so that the fused path really runs), float32: loss, accuracy and
    every gradient leaf within 1e-5 (the formulations differ only in float32 rounding). `chunk_rows` > 0: the
    loss in `head.tied_cross_entropy`'s chunks with the gradient in the forward (8 rows: 4 chunks of 2), as at
    the benchmark's equal-work shape; 0: the tiny head's logits fit one chunk, so the plain form runs."""
    from tupe_jax import attention as attention_lib  # pylint: disable=import-outside-toplevel
    from tupe_jax import model as model_lib  # pylint: disable=import-outside-toplevel
    from tupe_jax.pretrain.steps import make_train_step  # pylint: disable=import-outside-toplevel
    from tupe_jax import head as head_lib  # pylint: disable=import-outside-toplevel
    if chunk_rows:
        monkeypatch.setattr(head_lib, "CHUNK_BYTES", 4 * TINY["vocab_size"] * chunk_rows)
    cfg = config(pe, num_layers=2, dropout_rate=0.1, attention_dropout_rate=0.0, attention_backend=backend)
    params = init_params(cfg, jax.random.key(11))
    batch = jax.tree_util.tree_map(jnp.asarray, mlm_batch(seed=5))
    state = {"step": jnp.int32(0), "params": params, "opt_state": _grads_recorder().init(params),
             "rng": jax.random.PRNGKey(3)}
    step = jax.jit(make_train_step(TransformerLM(cfg), _grads_recorder(), optax.constant_schedule(0.0)))
    new_state, metrics = step(state, batch)
    grads = new_state["opt_state"]

    plain_cfg = dataclasses.replace(cfg, attention_backend="einsum")
    monkeypatch.setattr(attention_lib, "add_shared_bias", lambda logits, bias: logits + bias)
    for module in (attention_lib, model_lib):
        monkeypatch.setattr(module, "dense_dot_general", jax.lax.dot_general)
    monkeypatch.setattr(model_lib, "tied_logits", lambda h, e, dtype: h.astype(dtype) @ e.astype(dtype).T)
    monkeypatch.setattr(model_lib, "gelu", lambda x: jax.nn.gelu(x, approximate=False))
    rng = jax.random.fold_in(state["rng"], 0)   # what the train step draws its dropout from at step 0

    def plain(p):
        model = TransformerLM(plain_cfg)
        logits = model.apply({"params": p}, batch.inputs, input_mask=batch.input_mask, deterministic=False,
                             rngs={"dropout": rng})["logits"]
        rows = np.arange(batch.inputs.shape[0])[:, None]
        labels = jnp.zeros(batch.inputs.shape, jnp.int32).at[rows, batch.mlm_positions].add(
            batch.mlm_labels * (batch.mlm_weights > 0))
        weights = jnp.zeros(batch.inputs.shape, jnp.float32).at[rows, batch.mlm_positions].add(batch.mlm_weights)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        hits = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
        return jnp.sum(nll * weights) / jnp.sum(weights), jnp.sum(hits * weights) / jnp.sum(weights)

    (loss, accuracy), plain_grads = jax.jit(jax.value_and_grad(plain, has_aux=True))(params)
    assert np.isfinite(float(loss)) and float(loss) > 1.0
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
    assert float(metrics["accuracy"]) == float(accuracy)
    leaves = jax.tree_util.tree_leaves_with_path(plain_grads)
    assert sum(float(jnp.abs(x).max()) > 0 for _, x in leaves) >= len(leaves) - 1   # real gradients
    for (path, x), y in zip(leaves, jax.tree_util.tree_leaves(grads)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5, rtol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))


def test_argmax_hits_is_argmax_with_first_index_ties():
    """`argmax_hits` equals `argmax(logits) == label` including ties (the first maximal index wins), at random
    logits (several keys) and at rows built with exact ties before, at and after the label, and with ±inf logits."""
    from tupe_jax.head import argmax_hits  # pylint: disable=import-outside-toplevel
    cases = []
    for seed in range(4):
        logits = jax.random.normal(jax.random.key(seed), (4, 6, 16))
        cases.append((logits, jnp.argmax(logits, -1).at[:, ::2].set(seed)))
    ties = jnp.zeros((3, 16)).at[:, 5].set(2.0).at[:, 9].set(2.0)
    tie_labels = jnp.array([5, 9, 2])
    infinite = jnp.full((5, 16), -jnp.inf).at[3, 7].set(1.0).at[4, 2].set(jnp.inf).at[4, 6].set(jnp.inf)
    infinite_labels = jnp.array([0, 4, 15, 7, 6])
    cases += [(ties, tie_labels), (infinite, infinite_labels)]
    for x, y in cases:
        np.testing.assert_array_equal(np.asarray(argmax_hits(x, y)),
                                      np.asarray((jnp.argmax(x, -1) == y).astype(jnp.float32)))
    assert np.asarray(argmax_hits(ties, tie_labels)).tolist() == [1.0, 0.0, 0.0]
    assert np.asarray(argmax_hits(infinite, infinite_labels)).tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert np.asarray(argmax_hits(jnp.full((2, 16), jnp.nan), jnp.array([0, 3]))).tolist() == [0.0, 0.0]  # were 1.0
