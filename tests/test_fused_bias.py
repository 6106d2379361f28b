"""The fused attention paths keep the positional bias exact enough (issue #18): `xla` adds the float32 bias, and
cuDNN's inputs (`attention.cudnn_inputs`: causal ALiBi folded into four exact q/k columns, any other bias shifted by
its row maximum over the allowed keys, then bf16) stay within the kernel's own bf16 roundings of the float32 einsum
path on a long ALiBi and a TUPE-R input. CPU has no cuDNN: its arithmetic is modelled by the xla kernel on the
same bf16 inputs (`attention_fixtures.cudnn_like`; benchmarks/gpu_bias_precision.py measures the real kernel on a GPU)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tupe_jax.positional import PositionalSettings, make_positional
from tupe_jax.positional.alibi import alibi_slopes
from tests.attention_fixtures import (alibi_cases, bf16_bound, bias_cast_to_bf16, cudnn_like, einsum_reference,
                                     max_err, tupe_r_terms)


def test_xla_fused_path_keeps_a_long_alibi_bias_in_float32():
    """bf16 `fused_attention(backend='xla')` vs the float32 einsum path, causal ALiBi at 1024 tokens, 8 heads
    (slopes 2⁻¹…2⁻⁸: the bias reaches −511, where bf16's spacing is 2, i.e. up to 1 logit of rounding).

    q/k/v are bf16 values (the reference upcasts the same values), so the only differences allowed are the fused
    kernel's own bf16 roundings: probabilities before P·V and the output, ≤ 2u·max|v| with u = 2⁻⁸
    (`bf16_bound`). The bias must not add to that. Two inputs: random q/k (natural), and q/k whose content
    logit is +m_h·(i − j) (dims 0–1) so the softmax mass spreads over keys hundreds of tokens back, where the
    bias is largest — there the pre-fix path (bias cast to bf16) is ~3× over the bound, asserted below so the test
    fails if the bias is rounded again."""
    from tupe_jax.attention import fused_attention  # pylint: disable=import-outside-toplevel
    cases, terms, mask = alibi_cases(1024, 8, 8)
    fused = jax.jit(lambda q, k, v: fused_attention(q, k, v, terms, mask, "xla"))
    for name, (qq, kk, vv) in cases.items():
        ref = einsum_reference(qq, kk, vv, terms, mask)
        err, bound = max_err(fused(qq, kk, vv), ref), bf16_bound(vv)
        assert err <= bound, f"{name}: fused bf16 differs from float32 by {err:.4f} > {bound:.4f}"
        if name == "far keys":
            assert max_err(bias_cast_to_bf16(qq, kk, vv, terms, mask), ref) > bound  # the check can fail


def test_fused_paths_keep_a_tupe_r_bias_exact_enough():
    """TUPE-R's real bias (untied absolute term + T5 buckets with the [CLS] rows, 512 tokens, 8 heads × 32), its
    U^Q/U^K kernels ×9 and bucket table ×100 so the bias spans about ±34 (bf16 spacing 0.25 there). bf16 fused
    (`xla`) vs the float32 einsum path on bf16 q/k/v: within `bf16_bound` (the kernel's own roundings), for
    random q/k and for q = 0 (probabilities from the bias alone). The cuDNN preparation (`cudnn_inputs`: row-max
    shift, then bf16, as cuDNN takes it), run through the xla kernel here since CPU has no cuDNN (`cudnn_like`),
    stays within the same bound; the pre-fix cast does not (checked, so the test can fail)."""
    from tupe_jax.attention import fused_attention  # pylint: disable=import-outside-toplevel
    length, heads, hidden = 512, 8, 256
    terms = tupe_r_terms(length, heads, hidden, kernel_growth=9.0)
    assert 30 < float(jnp.abs(terms.logit_bias).max()) < 60 and terms.logit_bias.dtype == jnp.float32
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(2, length, heads, hidden // heads)), jnp.bfloat16) for _ in range(3))
    cudnn = cudnn_like(terms, None)
    old_errors = []
    for qq in (q, jnp.zeros_like(q)):
        ref, bound = einsum_reference(qq, k, v, terms, None), bf16_bound(v)
        assert max_err(jax.jit(lambda a, b, c: fused_attention(a, b, c, terms, None, "xla"))(qq, k, v), ref) <= bound
        assert max_err(cudnn(qq, k, v), ref) <= bound
        old_errors.append(max_err(bias_cast_to_bf16(qq, k, v, terms, None), ref) / bound)
    assert max(old_errors) > 1.5


def test_the_cudnn_preparation_keeps_a_long_causal_alibi_exact_enough():
    """Causal ALiBi at 1024 tokens through cuDNN's inputs (`cudnn_inputs`) vs the float32 einsum path, within
    `bf16_bound` for random q/k and for 'far keys' (the softmax mass hundreds of tokens back). Why it can fail:
    the shift by the row maximum over ALL keys (the code before: causal ALiBi's masked future keys carry up to
    +511) rounds every allowed entry at magnitude ~500 (observed 1.39 on an H200 against a bound of 0.042), and
    without the key-slope fold even the shift over allowed keys leaves 'far keys' at bf16's ~0.16; both asserted."""
    import dataclasses  # pylint: disable=import-outside-toplevel
    cases, terms, mask = alibi_cases(1024, 8, 8)
    fused, unfolded = cudnn_like(terms, mask), cudnn_like(dataclasses.replace(terms, key_slopes=None), mask)
    for name, (qq, kk, vv) in cases.items():
        ref, bound = einsum_reference(qq, kk, vv, terms, mask), bf16_bound(vv)
        err = max_err(fused(qq, kk, vv), ref)
        assert err <= bound, f"{name}: cuDNN's inputs give {err:.4f} > {bound:.4f}"
        shifted_over_all = (terms.logit_bias - terms.logit_bias.max(-1, keepdims=True)).astype(jnp.bfloat16)
        before = jax.nn.dot_product_attention(qq, kk, vv, bias=shifted_over_all, mask=mask,
                                              scale=terms.logit_scale, implementation="xla")
        assert max_err(before, ref) > 4 * bound
        if name == "far keys":   # the fold is needed: the shift alone leaves bf16's rounding of far entries
            assert max_err(unfolded(qq, kk, vv), ref) > 2 * bound
        else:                    # the shift over the allowed keys alone keeps the random case within the bound
            assert max_err(unfolded(qq, kk, vv), ref) <= bound


def test_the_cudnn_shift_takes_each_rows_maximum_over_its_allowed_keys():
    """`fused_bias(…, 'cudnn', bf16, mask)` for a causal + key-padding mask (B, 1, L, L) and a key-padding mask
    (B, 1, 1, L): in every row with an allowed key the largest allowed entry becomes exactly 0, whatever the masked
    entries hold (here the largest of all), and a row with no allowed key is left unshifted; without a mask the
    maximum runs over every key."""
    from tupe_jax.attention import attention_mask, fused_bias  # pylint: disable=import-outside-toplevel
    length = 6
    bias = jnp.asarray(np.random.default_rng(0).normal(size=(1, 2, length, length)), jnp.float32)
    bias = bias.at[..., -1].set(50.0)          # the last key: the row maximum, and padded in example 1
    key_padding = jnp.asarray([[1] * length, [1] * (length - 2) + [0, 0]])
    for causal in (True, False):
        mask = attention_mask(key_padding, length, causal)
        shifted = np.asarray(fused_bias(bias, "cudnn", jnp.bfloat16, mask), np.float32)
        allowed = np.broadcast_to(np.asarray(mask), shifted.shape)
        assert shifted.shape == (2, 2, length, length)
        for b, h, i in np.ndindex(2, 2, length):
            row = shifted[b, h, i][allowed[b, h, i]]
            assert row.size and row.max() == 0.0, (causal, b, h, i)
    assert float(np.asarray(fused_bias(bias, "cudnn", jnp.bfloat16), np.float32)[..., -1].max()) == 0.0
    nothing = jnp.zeros((1, 1, length, length), bool)
    np.testing.assert_array_equal(np.asarray(fused_bias(bias, "cudnn", jnp.bfloat16, nothing)),
                                  np.asarray(bias.astype(jnp.bfloat16)))


def test_the_fold_stays_within_cudnns_head_dim_limit():
    """Where the folded head dim would pass cuDNN's limit (128 before Hopper; here, off a GPU, 128 too), causal
    ALiBi keeps its shifted bf16 bias instead: head dim 128 would become 136. At head dim 64 it folds to 72."""
    from tupe_jax.attention import cudnn_inputs, cudnn_max_head_dim  # pylint: disable=import-outside-toplevel
    assert cudnn_max_head_dim() == 128
    _, terms, mask = alibi_cases(64, 2, 8)
    for dim, folded in ((64, 72), (128, None)):
        x = jnp.zeros((1, 64, 2, dim), jnp.bfloat16)
        q, k, v, bias = cudnn_inputs(x, x, x, terms, mask)
        if folded:
            assert q.shape[-1] == k.shape[-1] == v.shape[-1] == folded and bias is None
        else:
            assert q.shape[-1] == v.shape[-1] == dim and bias.dtype == jnp.bfloat16


def test_the_alibi_key_slope_fold_is_exact_and_keeps_the_gradients():
    """`key_slope_parts`: (q part · k part)·scale = m_h·j to ~1e-5 relative in bf16 (a bf16 bias would be off by up
    to 2⁻⁹ relative); and the folded bf16 attention's gradients w.r.t. q, k, v match the float32 einsum path to
    bf16 accuracy (relative L2 ≤ 2e-2), so the four extra columns carry no gradient into the model."""
    from tupe_jax.attention import key_slope_parts  # pylint: disable=import-outside-toplevel
    slopes, scale = jnp.asarray(alibi_slopes(12)), 64 ** -0.5
    qp, kp = key_slope_parts(slopes, scale, 4096, jnp.bfloat16)
    assert qp.dtype == kp.dtype == jnp.bfloat16 and qp.shape == (12, 4) and kp.shape == (4096, 4)
    got = jnp.einsum("hc,jc->hj", qp.astype(jnp.float32), kp.astype(jnp.float32)) * scale
    want = slopes[:, None] * jnp.arange(4096, dtype=jnp.float32)[None]
    assert float(jnp.max(jnp.abs(got - want))) < 1e-5 * float(jnp.max(want))
    assert float(jnp.max(jnp.abs(want.astype(jnp.bfloat16).astype(jnp.float32) - want))) > 1e-3 * float(want.max())
    cases, terms, mask = alibi_cases(256, 4, 8)
    q, k, v = cases["random"]
    fused = cudnn_like(terms, mask)

    def loss(fn, q, k, v):
        return jnp.sum(jnp.sin(fn(q, k, v).astype(jnp.float32)))

    ref = jax.grad(lambda *a: loss(lambda *b: einsum_reference(*b, terms, mask), *a), argnums=(0, 1, 2))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    got = jax.grad(lambda *a: loss(fused, *a), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        rel = float(jnp.linalg.norm(g.astype(jnp.float32) - r) / jnp.linalg.norm(r))
        assert rel <= 2e-2, rel


def test_causal_alibi_announces_its_key_slopes_and_a_merge_drops_them():
    """The ALiBi module's causal terms carry `key_slopes` m_h, and on every allowed key (j ≤ i) its bias minus
    m_h·j is constant along the row (what the fold relies on); the bidirectional bias is not of that form and
    carries none; merging with another bias drops them, merging with a bias-free scheme keeps them."""
    from tupe_jax.positional.base import PositionalTerms  # pylint: disable=import-outside-toplevel
    module = make_positional("alibi", PositionalSettings(hidden_size=32, num_heads=4, max_len=64, causal=True),
                             module_name=None)
    terms = module.apply({}, 64)
    np.testing.assert_array_equal(np.asarray(terms.key_slopes), alibi_slopes(4))
    rest = np.asarray(terms.logit_bias[0]) - np.asarray(terms.key_slopes)[:, None, None] * np.arange(64)[None, None]
    for i in range(64):
        np.testing.assert_allclose(rest[:, i, :i + 1], rest[:, i, :1] * np.ones((1, i + 1)), atol=1e-4)
    assert make_positional("alibi", PositionalSettings(hidden_size=32, num_heads=4, max_len=64, causal=False),
                           module_name=None).apply({}, 64).key_slopes is None
    other = PositionalTerms(logit_bias=jnp.zeros((1, 4, 64, 64)), logit_scale=terms.logit_scale)
    assert terms.merge(other).key_slopes is None and other.merge(terms).key_slopes is None
    plain = PositionalTerms(logit_scale=terms.logit_scale)
    assert terms.merge(plain).key_slopes is terms.key_slopes and plain.merge(terms).key_slopes is terms.key_slopes


def test_cudnn_bias_preparation_keeps_the_maths():
    """`fused_bias(b, 'cudnn', float32)` is b itself; the row-max shift it applies for bf16 is softmax-invariant:
    float32 attention with the shifted bias has the same output and bias gradient (to float32 rounding)."""
    from tupe_jax.attention import fused_bias  # pylint: disable=import-outside-toplevel
    bias = 20.0 * jax.random.normal(jax.random.key(0), (1, 2, 6, 6))
    q, k, v = (jax.random.normal(jax.random.key(i), (3, 6, 2, 4)) for i in (1, 2, 3))
    assert fused_bias(bias, "cudnn", jnp.float32) is bias and fused_bias(bias, "xla", jnp.bfloat16) is bias

    def out(b, shift):
        b = b - jax.lax.stop_gradient(b.max(-1, keepdims=True)) if shift else b
        return jnp.sum(jnp.sin(jax.nn.dot_product_attention(q, k, v, bias=b, implementation="xla")))

    (a, ga), (b, gb) = (jax.value_and_grad(out)(bias, s) for s in (False, True))
    np.testing.assert_allclose(float(b), float(a), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gb), np.asarray(ga), rtol=1e-4, atol=1e-6)
    shifted = fused_bias(bias, "cudnn", jnp.bfloat16)
    assert shifted.dtype == jnp.bfloat16 and float(shifted.max()) == 0.0


def test_the_per_layer_cudnn_preparation_compiles_to_one_copy():
    """Every layer calls `cudnn_inputs` on the same shared bias and mask (the shift is written per layer, as the
    attention module is); XLA's CSE must leave one row-maximum for the whole model, not one per layer."""
    import re  # pylint: disable=import-outside-toplevel
    from tupe_jax.attention import cudnn_inputs  # pylint: disable=import-outside-toplevel
    terms = tupe_r_terms(128, 4, 64, kernel_growth=9.0)
    padding = (jnp.arange(128)[None, :] < jnp.array([128, 100])[:, None])[:, None, None, :]
    layers = jax.random.normal(jax.random.key(0), (4, 3, 2, 128, 4, 16), jnp.bfloat16)   # (layer, q/k/v, B, L, H, d)

    def model(layers, bias):
        out = 0.0
        for q, k, v in layers:
            q, k, v, b = cudnn_inputs(q, k, v, dataclasses.replace(terms, logit_bias=bias), padding)
            out = out + jnp.sum(b.astype(jnp.float32) * jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32))
        return out

    text = jax.jit(model).lower(layers, terms.logit_bias).compile().as_text()
    assert len(re.findall(r"reduce\(.*to_apply=.*max", text)) == 1


@pytest.mark.parametrize("pe", ["alibi", "rope"])
def test_the_native_causal_mask_computes_the_same_model(pe, monkeypatch):
    """With `attention.NATIVE_CAUSAL_MASK` on, a causal model on the fused `xla` path hands the kernel is_causal
    instead of the triangle: the logits and every parameter gradient equal the explicit mask's bit for bit (jax's
    xla implementation builds the same triangle). The switch is taken (the kernel is called with is_causal and no
    mask, as recorded), and a batch with a key padding mask keeps its explicit mask."""
    from tupe_jax import attention  # pylint: disable=import-outside-toplevel
    from tupe_jax.model import ModelConfig, TransformerLM, init_params  # pylint: disable=import-outside-toplevel
    cfg = ModelConfig(pe=pe, objective="clm", untie_cls=False, vocab_size=64, hidden_size=32, num_layers=2,
                      num_heads=4, mlp_dim=64, max_len=16, dropout_rate=0.0, attention_dropout_rate=0.0,
                      attention_backend="xla")
    model, params = TransformerLM(cfg), init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 5, 64)
    padding = jnp.ones((2, 16), jnp.int32).at[1, 12:].set(0)

    def loss(p, input_mask=None):
        logits = model.apply({"params": p}, tokens, input_mask=input_mask, deterministic=True)["logits"]
        return jnp.sum(jnp.sin(logits)), logits

    calls, kernel = [], jax.nn.dot_product_attention

    def recorded(*args, mask=None, is_causal=False, **kwargs):
        calls.append((mask is None, is_causal))
        return kernel(*args, mask=mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recorded)
    runs, seen = {}, {}
    for native in (False, True):
        monkeypatch.setattr(attention, "NATIVE_CAUSAL_MASK", native)
        calls.clear()
        runs[native] = jax.jit(jax.value_and_grad(lambda p: loss(p), has_aux=True))(params)  # fresh: no trace cache
        seen[native] = set(calls)
        calls.clear()
        jax.jit(lambda p, m: loss(p, m))(params, padding)
        seen[native, "padded"] = set(calls)
    assert seen[False] == {(False, False)} and seen[True] == {(True, True)}
    assert seen[False, "padded"] == seen[True, "padded"] == {(False, False)}
    for a, b in zip(jax.tree_util.tree_leaves(runs[False]), jax.tree_util.tree_leaves(runs[True])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
