"""TUPE's and BERT-Ad's positional terms in the whole model: the position-position term against the paper's
equations with the [CLS] reset, TUPE-R's buckets, the shared term across layers, θ₁'s zero gradient, the parameter
overhead at base size, and BERT-Ad's four terms (the other whole-model properties: test_model.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tupe_jax.model import ModelConfig, Transformer, TransformerLM, count_params, init_params
from tests.model_fixtures import TINY, numpy_layer_norm, run, tiny, tokens


def reference_tupe_term(pos_params, length, head_dim, untie_cls=True):
    """TUPE's position-position term written from the paper (Eqs. 7, 9) + the official row convention."""
    named = {"table": pos_params["pos_table"], "ln_s": pos_params["pos_ln"]["scale"],
             "ln_b": pos_params["pos_ln"]["bias"], "uq": pos_params["pos_q"]["kernel"],
             "cq": pos_params["pos_q"]["bias"], "uk": pos_params["pos_k"]["kernel"], "ck": pos_params["pos_k"]["bias"]}
    p = {k: np.asarray(v, np.float64) for k, v in named.items()}
    rows = numpy_layer_norm(p["table"][: length + 1], p["ln_s"], p["ln_b"])
    pq = np.einsum("ld,dhk->hlk", rows, p["uq"]) + p["cq"][:, None]
    pk = np.einsum("ld,dhk->hlk", rows, p["uk"]) + p["ck"][:, None]
    scale = 1 / np.sqrt(2 * head_dim)
    heads = pq.shape[0]
    out = np.zeros((heads, length, length))
    for h in range(heads):
        theta1 = pq[h, 0] @ pk[h, 0] * scale
        theta2 = pq[h, 1] @ pk[h, 1] * scale
        for i in range(length):
            for j in range(length):
                if i == 0:
                    out[h, i, j] = theta1
                elif j == 0:
                    out[h, i, j] = theta2
                else:
                    out[h, i, j] = pq[h, i + 1] @ pk[h, j + 1] * scale
    return out


def positional_bias(cfg, params, length):
    terms = Transformer(cfg).apply({"params": params["encoder"]}, length, method=Transformer.positional_terms)
    return terms


def test_tupe_term_matches_paper_reference_with_cls_reset():
    cfg = tiny("tupe_a")
    params = init_params(cfg, jax.random.key(3))
    terms = positional_bias(cfg, params, 10)
    ref = reference_tupe_term(params["encoder"]["positional"]["proj"], 10, cfg.head_dim)
    np.testing.assert_allclose(np.asarray(terms.logit_bias[0]), ref, atol=1e-5)
    assert terms.logit_scale == pytest.approx(1 / np.sqrt(2 * cfg.head_dim))
    bias = np.asarray(terms.logit_bias[0])
    assert np.all(bias[:, 0, :] == bias[:, 0, :1]) and np.all(bias[:, 1:, 0] == bias[:, 1:2, 0])  # θ1 row, θ2 col


def test_tupe_r_adds_official_cls_buckets():
    cfg = tiny("tupe_r")
    params = init_params(cfg, jax.random.key(4))
    length = 10
    total = np.asarray(positional_bias(cfg, params, length).logit_bias[0])
    absolute = reference_tupe_term(params["encoder"]["positional"]["proj"], length, cfg.head_dim)
    table = np.asarray(params["encoder"]["positional"]["rel"]["rel_bias"])  # (33, H)
    assert table.shape == (33, cfg.num_heads)
    from tests.test_positional import reference_bucket
    for i in range(length):
        for j in range(length):
            bucket = 16 if i == 0 else 32 if j == 0 else reference_bucket(j - i, True)
            np.testing.assert_allclose(total[:, i, j], absolute[:, i, j] + table[bucket], atol=1e-5)


def layer0_projections(cfg, params, x):
    """(the model's outputs with hidden states and attention probabilities, layer 0's q/k/v (b, 3, l, h, d_h) in
    float64 from its input and the fused QKV kernel)."""
    out = run(cfg, params, x, return_hidden=True, return_attention=True)
    h0 = np.asarray(out["hidden_states"][0], np.float64)
    qkv = params["encoder"]["blocks_0"]["attention"]["qkv"]
    return out, np.einsum("bld,dthk->btlhk", h0, np.asarray(qkv["kernel"])) + np.asarray(qkv["bias"])[None, :, None]


def test_tupe_attention_is_word_term_plus_shared_position_term():
    """Layer-0 probs = softmax(word term/√(2d_h) + position term): no cross terms, same scale on both."""
    cfg = tiny("tupe_a", dropout_rate=0.0, attention_dropout_rate=0.0)
    params = init_params(cfg, jax.random.key(5))
    x = tokens(length=9)
    out, proj = layer0_projections(cfg, params, x)
    word = np.einsum("bqhk,bphk->bhqp", proj[:, 0], proj[:, 1]) / np.sqrt(2 * cfg.head_dim)
    pos = reference_tupe_term(params["encoder"]["positional"]["proj"], 9, cfg.head_dim)
    logits = word + pos[None]
    ref = np.exp(logits - logits.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(out["attentions"][0]), ref, atol=1e-5)


def test_tupe_position_term_is_shared_by_layers_and_input_independent():
    """With every word projection zeroed, each layer's attention is softmax(position term), for any input."""
    cfg = tiny("tupe_r", num_layers=3)
    params = init_params(cfg, jax.random.key(6))
    params = jax.tree_util.tree_map_with_path(
        lambda path, v: jnp.zeros_like(v) if "qkv" in jax.tree_util.keystr(path) else v, params)
    a = run(cfg, params, tokens(seed=1), return_attention=True)["attentions"]
    b = run(cfg, params, tokens(seed=2), return_attention=True)["attentions"]
    expected = jax.nn.softmax(positional_bias(cfg, params, 12).logit_bias, axis=-1)
    for layer in a + b:
        np.testing.assert_allclose(np.asarray(layer), np.broadcast_to(np.asarray(expected), layer.shape), atol=1e-6)


def test_theta1_cannot_change_output_and_has_exactly_zero_gradient():
    cfg = tiny("tupe_r", dropout_rate=0.0, attention_dropout_rate=0.0)
    params = init_params(cfg, jax.random.key(7))
    x = tokens()

    def loss(p):
        return jnp.mean(run(cfg, p, x)["logits"] ** 2)

    def with_row(row):
        table = params["encoder"]["positional"]["proj"]["pos_table"]
        delta = 3.0 * jax.random.normal(jax.random.key(row), table.shape[1:])  # not constant: LN removes that
        new = jax.tree_util.tree_map(lambda v: v, params)
        new["encoder"]["positional"]["proj"]["pos_table"] = table.at[row].add(delta)
        return new

    def change(new):
        a = run(cfg, params, x, return_attention=True)["attentions"]
        b = run(cfg, new, x, return_attention=True)["attentions"]
        return max(float(jnp.abs(pa - pb).max()) for pa, pb in zip(a, b))

    assert change(with_row(0)) < 1e-6   # θ1's vector moved: no attention probability changes
    assert change(with_row(1)) > 1e-4   # θ2's vector moved: attention to [CLS] changes
    grads = jax.grad(loss)(params)
    g_table = np.asarray(grads["encoder"]["positional"]["proj"]["pos_table"])
    assert np.all(g_table[0] == 0.0)
    assert np.abs(g_table[1]).max() > 0 and np.abs(g_table[2]).max() > 0
    assert np.all(np.asarray(grads["encoder"]["positional"]["rel"]["rel_bias"])[16] == 0.0)  # the [CLS]-row bucket


def test_tupe_in_causal_decoder_has_no_cls():
    cfg = tiny("tupe_a", "clm")
    params = init_params(cfg, jax.random.key(0))
    assert params["encoder"]["positional"]["proj"]["pos_table"].shape[0] == TINY["max_len"]  # no extra θ rows


def test_tupe_parameter_overhead_for_base():
    base = dict(vocab_size=30522, hidden_size=768, num_layers=12, num_heads=12, mlp_dim=3072, max_len=512)

    def n_params(pe):
        cfg = ModelConfig(pe=pe, **base)
        shapes = jax.eval_shape(lambda: TransformerLM(cfg).init({"params": jax.random.key(0)},
                                                                jnp.zeros((1, 8), jnp.int32)))
        return count_params(shapes["params"])

    counts = {pe: n_params(pe) for pe in ("bert_a", "bert_r", "tupe_a", "tupe_r", "bert_ad", "nopos")}
    # the six numbers quoted in README.md ("Parameter counts for size=base"), exactly
    assert counts == {"bert_a": 109_512_762, "bert_r": 109_513_146, "tupe_a": 110_696_250, "tupe_r": 110_696_646,
                      "bert_ad": 110_695_482, "nopos": 109_119_546}
    bert_a, tupe_a, tupe_r = counts["bert_a"], counts["tupe_a"], counts["tupe_r"]
    # U^Q, U^K with biases (2·(768²+768)) + position LayerNorm (2·768) + the extra [CLS] row (768)
    assert tupe_a - bert_a == 2 * (768 * 768 + 768) + 2 * 768 + 768 == 1_183_488
    assert tupe_r - tupe_a == 33 * 12                      # 32 relative buckets + the [CLS] column's, per head
    assert counts["bert_r"] - bert_a == 32 * 12            # relative buckets only
    assert counts["bert_ad"] - bert_a == tupe_a - bert_a - 768  # the same projections, no untied [CLS] row
    assert bert_a - counts["nopos"] == 512 * 768           # the absolute position table


# ------------------------------------------------------------------------------------------ bert_ad
def test_bert_ad_keeps_all_four_terms_scaled_by_sqrt_4dh():
    cfg = tiny("bert_ad", dropout_rate=0.0, attention_dropout_rate=0.0)
    params = init_params(cfg, jax.random.key(8))
    x = tokens(length=7)
    out, proj = layer0_projections(cfg, params, x)
    proj_p = params["encoder"]["positional"]["proj"]
    rows = numpy_layer_norm(np.asarray(proj_p["pos_table"], np.float64)[:7], np.asarray(proj_p["pos_ln"]["scale"]), np.asarray(proj_p["pos_ln"]["bias"]))
    pq = np.einsum("ld,dhk->lhk", rows, np.asarray(proj_p["pos_q"]["kernel"])) + np.asarray(proj_p["pos_q"]["bias"])
    pk = np.einsum("ld,dhk->lhk", rows, np.asarray(proj_p["pos_k"]["kernel"])) + np.asarray(proj_p["pos_k"]["bias"])
    q, k = proj[:, 0], proj[:, 1]
    logits = (np.einsum("bqhd,bphd->bhqp", q, k) + np.einsum("bqhd,phd->bhqp", q, pk)
              + np.einsum("qhd,bphd->bhqp", pq, k) + np.einsum("qhd,phd->hqp", pq, pk)[None]) / np.sqrt(4 * cfg.head_dim)
    ref = np.exp(logits - logits.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(out["attentions"][0]), ref, atol=1e-5)
