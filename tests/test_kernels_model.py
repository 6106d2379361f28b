"""The Pallas flash-attention kernel in the model (issue #18): `attention_backend='pallas'` trains as the einsum
model does (loss and gradients, dropout masks from the same keys), falls back to the einsum path where the kernel
does not run, keeps long ALiBi and TUPE-R biases exact enough in bf16, and refuses to train with a mask hashed in
the kernel on a GPU. The kernel runs through Pallas' interpreter here (the kernel alone: test_kernels.py).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tupe_jax import attention
from tupe_jax.model import ModelConfig, TransformerLM
from tupe_jax.positional.base import PositionalTerms
from tests.attention_fixtures import alibi_cases, bf16_bound, einsum_reference, max_err, tupe_r_terms

KEY = jax.random.PRNGKey(42)
TINY = dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=2, mlp_dim=64, max_len=64, dropout_bits=16,
            dropout_rate=0.1, attention_dropout_rate=0.1)


def _loss_and_grads(cfg, params=None, key=None):
    """(params, (loss, grads)) of a training-mode forward with dropout rng `key` (PRNGKey(7)); asserts whether the
    kernel is in the program."""
    key = jax.random.PRNGKey(7) if key is None else key
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 64), 0, 128)    # batch 3 ≠ 2 heads: the mask's axes
    input_mask = jnp.ones((3, 64), jnp.int32).at[1, 50:].set(0)
    model = TransformerLM(cfg)
    params = model.init({"params": jax.random.PRNGKey(0)}, tokens)["params"] if params is None else params

    def loss(p):
        out = model.apply({"params": p}, tokens, input_mask=input_mask, deterministic=False,
                          rngs={"dropout": key})
        return jnp.mean(out["logits"] ** 2)

    step = jax.value_and_grad(loss)
    assert ("pallas_call" in str(jax.make_jaxpr(step)(params))) == (cfg.attention_backend == "pallas")
    return params, jax.jit(step)(params)


@pytest.mark.parametrize("pe,objective,source,rng", [
    ("tupe_r", "mlm", "precomputed", "threefry"), ("alibi", "clm", "precomputed", "threefry"),
    ("rope", "mlm", "in_kernel", "threefry"), ("tupe_a", "mlm", "precomputed", "rbg")])
def test_the_pallas_backend_is_the_einsum_model(pe, objective, source, rng, monkeypatch):
    """The whole model in training mode (dropout 0.1 everywhere, a padded row): `attention_backend='pallas'` with
    the kernel (interpreted) gives the einsum backend's loss and gradients: the kernel uses the same attention
    masks from the same keys, whether precomputed (from a threefry or an rbg key) or hashed in the kernel.
    Gradients to 1e-5 of the largest one (a bias gradient that is zero in exact maths, TUPE's key-projection bias,
    holds only rounding in both)."""
    monkeypatch.setattr(attention, "PALLAS_OFF_GPU", "interpret")
    monkeypatch.setattr(attention, "PALLAS_DROPOUT_MASK", source)
    key = jax.random.key(7, impl="rbg") if rng == "rbg" else None      # typed, as `optim.dropout_key` makes it
    cfg = ModelConfig(**TINY, pe=pe, objective=objective, untie_cls=objective == "mlm")
    params, (loss, grads) = _loss_and_grads(cfg, key=key)
    _, (kernel_loss, kernel_grads) = _loss_and_grads(dataclasses.replace(cfg, attention_backend="pallas"), params,
                                                     key)
    np.testing.assert_allclose(float(kernel_loss), float(loss), rtol=1e-5)
    scale = max(float(jnp.abs(x).max()) for x in jax.tree_util.tree_leaves(grads))
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves(kernel_grads)):
        np.testing.assert_allclose(np.asarray(y) / scale, np.asarray(x) / scale, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("setting", ["off the GPU", "32-bit masks", "rbg key, mask hashed in the kernel",
                                     "length 48"])
def test_where_the_kernel_does_not_run_the_einsum_path_does_with_the_same_masks(setting, monkeypatch):
    """Off a GPU (the default), with flax's 32-bit masks, an rbg dropout key where the kernel would hash the mask
    itself (it hashes threefry only) or an untileable length, `pallas` runs the einsum path: bit for bit the
    einsum backend's loss and gradients."""
    cfg = ModelConfig(**TINY, pe="tupe_r")
    key = jax.random.PRNGKey(7)
    if setting != "off the GPU":
        monkeypatch.setattr(attention, "PALLAS_OFF_GPU", "interpret")
    if setting == "32-bit masks":
        cfg = dataclasses.replace(cfg, dropout_bits=32)
    if setting.startswith("rbg key"):
        key = jax.random.key(7, impl="rbg")        # typed, as `optim.dropout_key` makes it
        monkeypatch.setattr(attention, "PALLAS_DROPOUT_MASK", "in_kernel")
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 48 if setting == "length 48" else 64), 0, 128)

    def loss_and_grads(backend, params=None):
        model = TransformerLM(dataclasses.replace(cfg, attention_backend=backend))
        params = model.init({"params": jax.random.PRNGKey(0)}, tokens)["params"] if params is None else params
        loss = lambda p: jnp.mean(model.apply({"params": p}, tokens, deterministic=False,  # noqa: E731
                                              rngs={"dropout": key})["logits"] ** 2)
        return params, jax.jit(jax.value_and_grad(loss))(params)

    params, expected = loss_and_grads("einsum")
    _, got = loss_and_grads("pallas", params)
    for e, g in zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


def test_the_kernel_keeps_long_alibi_and_tupe_r_biases_exact_enough():
    """The bias precision checks of tests/test_perf.py for the xla path, on the kernel: bf16 q/k/v against the
    float32 einsum path on the same values, within `bf16_bound` (the kernel's own bf16 roundings: probabilities
    before P·V and the output; the float32 bias adds nothing): causal ALiBi at 1024 tokens (bias down to −511,
    'random' and 'far keys' q/k) and TUPE-R's bias grown to about ±34 at 512 tokens (random q/k and q = 0). The
    same kernel given the ALiBi bias rounded to bf16 exceeds the bound on the far keys."""
    def run(terms, mask):
        return jax.jit(lambda q, k, v: attention.pallas_attention(q, k, v, terms, mask, 0.0, None))

    cases, terms, mask = alibi_cases(1024, 8, 8)
    for name, (q, k, v) in cases.items():
        q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
        ref = einsum_reference(q, k, v, terms, mask)
        err = max_err(run(terms, mask)(q, k, v), ref)
        assert err <= bf16_bound(v), f"ALiBi {name}: {err:.4f} > {bf16_bound(v):.4f}"
        if name == "far keys":   # the check can fail: the same kernel given a bias rounded to bf16 exceeds it
            rounded = dataclasses.replace(terms, logit_bias=terms.logit_bias.astype(jnp.bfloat16).astype(jnp.float32))
            assert max_err(run(rounded, mask)(q, k, v), ref) > bf16_bound(v)
    terms = tupe_r_terms(512, 8, 256, kernel_growth=9.0)
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 512, 8, 32)), jnp.bfloat16) for _ in range(3))
    for qq in (q, jnp.zeros_like(q)):
        err = max_err(run(terms, None)(qq, k, v), einsum_reference(qq, k, v, terms, None))
        assert err <= bf16_bound(v), f"TUPE-R: {err:.4f} > {bf16_bound(v):.4f}"


def test_training_refuses_the_pallas_kernel_hashing_its_dropout_mask_on_a_gpu(monkeypatch):
    """On an H200 the kernel's backward with its dropout mask hashed in the kernel did not finish compiling
    (RESULTS.md, GPU round 2), so with `attention.PALLAS_DROPOUT_MASK = "in_kernel"` a pretraining or fine-tuning
    config that would train through it on a GPU is refused before any compute, with the way out in the line; the
    precomputed masks (the default), the einsum path (same masks), dropout 0, 32-bit masks or rbg keys (which the
    kernel does not hash: the einsum path runs for them in this form) and any other platform pass."""
    from configs.glue import get_config as glue_config  # pylint: disable=import-outside-toplevel
    from configs.pretrain import get_config  # pylint: disable=import-outside-toplevel
    from tupe_jax import model as model_lib  # pylint: disable=import-outside-toplevel
    from tupe_jax.errors import UserError  # pylint: disable=import-outside-toplevel
    from tupe_jax.finetune import validate as finetune_validate  # pylint: disable=import-outside-toplevel
    from tupe_jax.pretrain import validate as pretrain_validate  # pylint: disable=import-outside-toplevel

    def stalling(config):
        with config.unlocked():
            config.model.attention_backend, config.model.attention_dropout_rate = "pallas", 0.1
            config.model.dropout_bits = 16
        return config

    config = stalling(get_config("pe=tupe_r,size=tiny"))
    model_lib.validate_training(config, "gpu", (128,))          # the precomputed masks: no hash in the kernels
    monkeypatch.setattr(attention, "PALLAS_DROPOUT_MASK", "in_kernel")
    with pytest.raises(UserError, match="pallas with attention dropout hashed in the kernel does not train") as error:
        model_lib.validate_training(config, "gpu", (128,))
    assert "attention.PALLAS_DROPOUT_MASK" in str(error.value) and "precomputed" in str(error.value)
    assert str(error.value).count("\n") == 0
    monkeypatch.setattr(attention, "PALLAS_DROPOUT_MASK", "in-kernel")     # a misspelt source: refused as well
    with pytest.raises(UserError, match="attention.PALLAS_DROPOUT_MASK"):
        model_lib.validate_training(config, "gpu", (128,))
    q = jnp.zeros((1, 64, 1, 16))
    with pytest.raises(ValueError, match="'in-kernel': not one of"):
        attention.pallas_attention(q, q, q, PositionalTerms(), None, 0.1, KEY)
    monkeypatch.setattr(attention, "PALLAS_DROPOUT_MASK", "in_kernel")
    model_lib.validate_training(config, "cpu", (128,))
    for key, value in (("attention_dropout_rate", 0.0), ("attention_backend", "einsum"), ("dropout_bits", 32)):
        passing = stalling(get_config("pe=tupe_r,size=tiny"))
        passing.model[key] = value
        model_lib.validate_training(passing, "gpu", (128,))
    passing = stalling(get_config("pe=tupe_r,size=tiny"))
    passing.train.dropout_rng = "rbg"
    model_lib.validate_training(passing, "gpu", (128,))
    model_lib.validate_training(config, "gpu", (100, 32))   # no length the kernel tiles: the einsum path trains
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    pretraining = stalling(get_config("pe=tupe_r,size=tiny"))
    pretraining.model.max_len = 100       # the validator passes the lengths the loop trains at
    pretrain_validate.validate(pretraining, 1)
    glue = stalling(glue_config("task=rte"))
    glue.model.max_len, glue.data.glue_buckets = 100, (64,)   # the 64-token bucket runs the kernel
    with pytest.raises(UserError, match="pallas with attention dropout"):
        finetune_validate.validate(glue, 1)
    with pytest.raises(UserError, match="pallas with attention dropout"):
        pretrain_validate.validate(config, 1)
    with pytest.raises(UserError, match="pallas with attention dropout"):
        finetune_validate.validate(stalling(glue_config("task=rte")), 1)
