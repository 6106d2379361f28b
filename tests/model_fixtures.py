"""The tiny model the whole-model tests share (test_model, test_model_tupe): its config, random tokens, a jitted
forward pass, and LayerNorm in numpy for the references written from the papers."""
import functools

import jax
import numpy as np

from tupe_jax.model import ModelConfig, TransformerLM

TINY = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64, max_len=16)


def tiny(pe, objective="mlm", **kw):
    return ModelConfig(pe=pe, objective=objective, **{**TINY, **kw})


def tokens(batch=2, length=12, seed=0):
    return jax.random.randint(jax.random.key(seed), (batch, length), 5, TINY["vocab_size"])


@functools.partial(jax.jit, static_argnums=0, static_argnames=("position_offset", "return_hidden", "return_attention"))
def run(cfg, params, toks, **kw):
    return TransformerLM(cfg).apply({"params": params}, toks, **kw)



def numpy_layer_norm(x, scale, bias, eps=1e-5):
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * scale + bias
