"""Inputs and the float32 reference for the fused-attention bias checks, shared by tests/test_fused_bias.py (CPU) and
benchmarks/gpu_bias_precision.py (the same checks on a GPU's kernels).

    alibi_cases(length, heads, dim) -> ({name: (q, k, v)}, terms, mask)   causal ALiBi; bfloat16 q/k/v
    tupe_r_terms(length, heads, hidden, kernel_growth) -> terms             TUPE-R's real bias, magnified
    einsum_reference(q, k, v, terms, mask) -> float32 attention output     the einsum path on the same values
    bias_cast_to_bf16(q, k, v, terms, mask) -> output                      the pre-fix path (bias rounded first)
    bf16_bound(v) -> tolerance;  max_err(out, ref) -> max |out − ref|
"""
from __future__ import annotations

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tupe_jax.attention import attention_logits, attention_mask
from tupe_jax.positional import PositionalSettings, make_positional
from tupe_jax.positional.alibi import alibi_bias, alibi_slopes
from tupe_jax.positional.base import PositionalTerms

U_BF16 = 2.0 ** -8   # bfloat16 unit roundoff (8 significant bits, round to nearest)


def alibi_cases(length: int, heads: int, dim: int):
    """Causal ALiBi at `length` tokens: 'random' q/k, and 'far keys' q/k whose content logit is +m_h·(i − j)
    (dims 0–1), so the softmax mass spreads over keys far back, where the bias is largest. One v for both; q/k/v
    are drawn in float32 and rounded to bfloat16 (the fused kernels' input dtype; the reference upcasts them)."""
    scale = 1.0 / np.sqrt(dim)
    terms = PositionalTerms(logit_bias=alibi_bias(length, heads, True), logit_scale=float(scale),
                            key_slopes=jnp.asarray(alibi_slopes(heads)))
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(1, length, heads, dim)).astype(np.float32) for _ in range(3))
    slopes, pos = alibi_slopes(heads)[None, :], np.arange(length, dtype=np.float32)[:, None]
    q_far, k_far = q.copy(), k.copy()
    q_far[0, :, :, 0], q_far[0, :, :, 1] = slopes * pos / scale, -1.0 / scale
    k_far[0, :, :, 0], k_far[0, :, :, 1] = 1.0, slopes * pos
    cases = {"random": (q, k, v), "far keys": (q_far, k_far, v)}
    cases = {name: tuple(jnp.asarray(x, jnp.bfloat16) for x in xs) for name, xs in cases.items()}
    return cases, terms, attention_mask(None, length, True)


def tupe_r_terms(length: int, heads: int, hidden: int, kernel_growth: float) -> PositionalTerms:
    """TUPE-R's terms (untied absolute term + T5 buckets with the [CLS] rows) with U^Q/U^K × `kernel_growth` and
    the bucket table × 100, so the bias spans tens of logits (float32)."""
    module = make_positional("tupe_r", PositionalSettings(hidden_size=hidden, num_heads=heads, max_len=length),
                             module_name=None)
    flat = flax.traverse_util.flatten_dict(nn.meta.unbox(module.init(jax.random.key(0), length)))
    grow = {"kernel": kernel_growth, "rel_bias": 100.0}
    return module.apply(flax.traverse_util.unflatten_dict({p: x * grow.get(p[-1], 1.0) for p, x in flat.items()}),
                        length)


def einsum_reference(q, k, v, terms, mask):
    """The float32 einsum path (explicit float32 logits + bias, softmax, P·V) on the same (bf16-exact) q/k/v."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    probs = jax.nn.softmax(attention_logits(q, k, terms, mask), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def cudnn_like(terms, mask):
    """What cuDNN computes from `attention.cudnn_inputs` (its bf16 q/k/v and bias), run through the xla kernel:
    float32 logits and softmax, the output sliced back. A CPU model of cuDNN's arithmetic: the code before the
    allowed-key shift failed on an H200 by about the margin this model gives it (1.39 against a bound of 0.042,
    benchmarks/results_gpu_h200_bias_precision.json). Jitted; (q, k, v) -> output."""
    from tupe_jax.attention import cudnn_inputs  # pylint: disable=import-outside-toplevel

    def run(q, k, v):
        qc, kc, vc, bias = cudnn_inputs(q, k, v, terms, mask)
        return jax.nn.dot_product_attention(qc, kc, vc, bias=bias, mask=mask, scale=terms.logit_scale,
                                            implementation="xla")[..., :v.shape[-1]]
    return jax.jit(run)


def bias_cast_to_bf16(q, k, v, terms, mask):
    """What the fused path did before: the bias rounded to bfloat16 before the kernel."""
    return jax.nn.dot_product_attention(q, k, v, bias=terms.logit_bias.astype(jnp.bfloat16), mask=mask,
                                        scale=terms.logit_scale, implementation="xla")


def max_err(out, ref) -> float:
    return float(np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32)).max())


def bf16_bound(v) -> float:
    """|fused − reference| ≤ u·Σ_j p_j|v_j| (probs rounded to bf16 before P·V) + u·|o| (output rounded to bf16)
    ≤ 2u·max|v|, plus 1e-4 for float32 summation-order differences in the logits and softmax."""
    return 2 * U_BF16 * float(jnp.abs(v.astype(jnp.float32)).max()) + 1e-4
