"""`tupe_a` / `tupe_r`: Transformer with Untied Positional Encoding (Ke, He, Liu, ICLR 2021).

No position is added at the input. Positions get their own projections U^Q, U^K (d × d with bias, one pair
SHARED BY ALL LAYERS, sliced per head) applied to a LayerNorm'd position table P, and the logits of every layer
are the sum of a per-layer word term and one position term computed once per forward:

    logit_ij = (x_i W^Q)·(x_j W^K) / √(2·d_h)  +  reset_θ( (LN(p_i) U^Q)·(LN(p_j) U^K) / √(2·d_h) )  [+ b_{bucket(j−i)}]

There are no word↔position cross terms, and both terms share the 1/√(2·d_h) scale. `tupe_r` adds the T5
bucketed bias b (`relative.py`).

Untied [CLS] (`untie_cls`, on by default in the encoder; there is no [CLS] in a causal decoder):
    reset_θ(v, i, j) = θ1 if i = 0 (the [CLS] row, incl. the corner);  θ2 if j = 0, i ≠ 0;  v_ij otherwise,
with per-head θ1, θ2 obtained from two dedicated position vectors through U^Q/U^K, as in the official code:
the table has max_len + 1 rows, θ1 is the self-correlation of row 0 and θ2 that of row 1, and token t uses row
t + 1. TUPE-R follows the official code rather than the paper's Eq. 11: the reset is applied to the absolute
term and, separately, [CLS] gets its own relative buckets (`relative.py`); the two are added. (The paper resets
abs + rel once; both give one learnable scalar per head and direction.)

θ1 adds the same constant to every logit of the [CLS] row, so softmax removes it and its true gradient is 0.
We pass the [CLS] row through stop_gradient so autodiff returns exactly 0 instead of rounding noise that Adam
would otherwise normalise into ±lr steps.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from tupe_jax.positional.base import (PositionalSettings, PositionalTerms, check_table_length, normal_init)
from tupe_jax.positional.relative import RelativeBias


class PositionProjections(nn.Module):
    """LayerNorm'd position rows -> per-head position queries and keys, (L, H, d_h) each, float32."""

    settings: PositionalSettings
    rows: int

    @nn.compact
    def __call__(self, start: int, length: int) -> tuple[jax.Array, jax.Array]:
        s = self.settings
        table = self.param("pos_table", normal_init(0.02, ("pos", "embed")), (self.rows, s.hidden_size), jnp.float32)
        p = nn.meta.unbox(table)[start:start + length]
        p = nn.LayerNorm(epsilon=s.layer_norm_eps, name="pos_ln",
                         scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                         bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)))(p)

        def project(name: str) -> jax.Array:
            return nn.DenseGeneral(
                (s.num_heads, s.head_dim), name=name,
                kernel_init=normal_init(0.02, ("embed", "heads", "kv")),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("heads", "kv")))(p)

        return project("pos_q"), project("pos_k")


def tupe_scale(settings: PositionalSettings) -> float:
    """1/√(2·d_h), shared by the word and the position term."""
    return (2 * settings.head_dim) ** -0.5


def reset_cls(corr: jax.Array, theta1: jax.Array, theta2: jax.Array) -> jax.Array:
    """(H, L, L) correlation -> column 0 set to θ2, then row 0 (incl. the corner) set to θ1."""
    corr = corr.at[:, :, 0].set(theta2[:, None])
    return corr.at[:, 0, :].set(theta1[:, None])


class UntiedPositional(nn.Module):
    """`tupe_a` (relative=False) and `tupe_r` (relative=True)."""

    settings: PositionalSettings
    relative: bool = False

    def setup(self):
        s = self.settings
        self.proj = PositionProjections(s, rows=s.max_len + int(s.has_cls))
        if self.relative:
            self.rel = RelativeBias(s, untie_cls=s.has_cls)

    def positional_correlation(self, length: int, offset: int = 0) -> jax.Array:
        """The input-independent position term (H, L, L) after the [CLS] reset, without the T5 bias."""
        s = self.settings
        cls = s.has_cls
        scale = tupe_scale(s)
        if cls and offset:
            raise ValueError("an untied [CLS] sits at index 0; position offsets are not defined for it")
        check_table_length(offset + length, s.max_len, "tupe")
        qp, kp = self.proj(offset, length + int(cls))
        if not cls:
            return jnp.einsum("qhd,khd->hqk", qp, kp) * scale
        theta1 = jnp.sum(qp[0] * kp[0], axis=-1) * scale   # (H,) row 0 = p_θ1
        theta2 = jnp.sum(qp[1] * kp[1], axis=-1) * scale   # (H,) row 1 = p_θ2
        corr = jnp.einsum("qhd,khd->hqk", qp[1:], kp[1:]) * scale  # token t uses row t + 1
        return reset_cls(corr, theta1, theta2)

    def __call__(self, length: int, offset: int = 0) -> PositionalTerms:
        s = self.settings
        bias = self.positional_correlation(length, offset)[None]
        if self.relative:
            bias = bias + self.rel(length, offset).logit_bias
        if s.has_cls:
            bias = jnp.concatenate([jax.lax.stop_gradient(bias[:, :, :1]), bias[:, :, 1:]], axis=2)
        return PositionalTerms(logit_bias=bias.astype(jnp.float32), logit_scale=tupe_scale(s))


class DisentangledAbsolute(nn.Module):
    """`bert_ad`: BERT-A with separate word and position projections keeping all four terms (TUPE §4.3).

        logit_ij = (x_i W^Q + p_i U^Q)·(x_j W^K + p_j U^K) / √(4·d_h)
                 = [ww + wp + pw + pp] / √(4·d_h)

    No position at the input; p = LN(position table); U^Q, U^K shared by all layers and computed once per
    forward; they enter as a q/k transform (q ← q + pU^Q, k ← k + pU^K), so the cross terms use each layer's x.
    """

    settings: PositionalSettings

    @nn.compact
    def __call__(self, length: int, offset: int = 0) -> PositionalTerms:
        s = self.settings
        check_table_length(offset + length, s.max_len, "bert_ad")
        qp, kp = PositionProjections(s, rows=s.max_len, name="proj")(offset, length)

        def add_positions(q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
            return (q + qp[None].astype(q.dtype)), (k + kp[None].astype(k.dtype))

        return PositionalTerms(qk_transform=add_positions, logit_scale=(4 * s.head_dim) ** -0.5)
