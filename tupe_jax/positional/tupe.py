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

Two equivalent forms (`form`, from `model.tupe_form`); same parameters, same attention to float rounding:

- `bias` (default): the position term above is one (1, H, L, L) logit bias, computed once per forward.
- `concat`: no bias for the absolute part; every layer attends with concatenated heads
      q'_i = [x_i W^Q ; p_i U^Q ; a_i],   k'_j = [x_j W^K ; p_j U^K ; b_j],   scale 1/√(2·d_h),
  so q'·k' = word term + position term. With the untied [CLS]: the position parts of token 0 are zeroed (its
  row becomes the constant 0 instead of θ1, which softmax removes anyway), a_i = 1 for i ≥ 1 (0 for i = 0),
  b_0 = θ2·√(2·d_h) and b_j = 0 otherwise, so column 0 gets exactly θ2. Head dim 2·d_h (+1 with [CLS]), padded
  with zeros to a multiple of 8. This lets TUPE-A run on fused flash kernels that take no bias (cuDNN, splash);
  `tupe_r` keeps its T5 term (with the [CLS] buckets) as the only logit bias.
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


TUPE_FORMS = ("bias", "concat")


def _round_up(n: int, multiple: int = 8) -> int:
    return -(-n // multiple) * multiple


class UntiedPositional(nn.Module):
    """`tupe_a` (relative=False) and `tupe_r` (relative=True); `form` 'bias' or 'concat' (see the module doc)."""

    settings: PositionalSettings
    relative: bool = False
    form: str = "bias"

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
        check_table_length(offset + length, s.max_len)
        qp, kp = self.proj(offset, length + int(cls))
        if not cls:
            return jnp.einsum("qhd,khd->hqk", qp, kp) * scale
        theta1 = jnp.sum(qp[0] * kp[0], axis=-1) * scale   # (H,) row 0 = p_θ1
        theta2 = jnp.sum(qp[1] * kp[1], axis=-1) * scale   # (H,) row 1 = p_θ2
        corr = jnp.einsum("qhd,khd->hqk", qp[1:], kp[1:]) * scale  # token t uses row t + 1
        return reset_cls(corr, theta1, theta2)

    def concat_parts(self, length: int, offset: int = 0) -> tuple[jax.Array, jax.Array]:
        """Position parts appended to every layer's queries and keys: (L, H, m) each, float32, with
        m = round_up(d_h + [CLS], 8); their dot product × 1/√(2·d_h) is the position term up to the θ1 row."""
        s = self.settings
        cls = s.has_cls
        if cls and offset:
            raise ValueError("an untied [CLS] sits at index 0; position offsets are not defined for it")
        check_table_length(offset + length, s.max_len)
        qp, kp = self.proj(offset, length + int(cls))
        if cls:
            theta2 = jnp.sum(qp[1] * kp[1], axis=-1)                         # (H,) θ2·√(2d_h), row 1 = p_θ2
            not_cls = (jnp.arange(length) > 0).astype(jnp.float32)[:, None, None]  # (L, 1, 1)
            qp, kp = qp[1:] * not_cls, kp[1:] * not_cls                       # token t uses row t + 1
            q_extra = jnp.broadcast_to(not_cls, (length, s.num_heads, 1))
            k_extra = (1.0 - not_cls) * theta2[None, :, None]                 # b_0 = θ2·√(2d_h), else 0
            qp = jnp.concatenate([qp, q_extra], axis=-1)
            kp = jnp.concatenate([kp, k_extra], axis=-1)
        pad = _round_up(qp.shape[-1]) - qp.shape[-1]
        if pad:
            widths = ((0, 0), (0, 0), (0, pad))
            qp, kp = jnp.pad(qp, widths), jnp.pad(kp, widths)
        return qp, kp

    def __call__(self, length: int, offset: int = 0) -> PositionalTerms:
        s = self.settings
        if self.form not in TUPE_FORMS:
            raise ValueError(f"unknown TUPE form {self.form!r}; use one of {TUPE_FORMS}")
        if self.form == "concat":
            return self._concat_terms(length, offset)
        bias = self.positional_correlation(length, offset)[None]
        if self.relative:
            bias = bias + self.rel(length, offset).logit_bias
        if s.has_cls:
            bias = jnp.concatenate([jax.lax.stop_gradient(bias[:, :, :1]), bias[:, :, 1:]], axis=2)
        return PositionalTerms(logit_bias=bias.astype(jnp.float32), logit_scale=tupe_scale(s))

    def _concat_terms(self, length: int, offset: int) -> PositionalTerms:
        s = self.settings
        qp, kp = self.concat_parts(length, offset)

        def concat_heads(q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
            shape = q.shape[:-1] + (qp.shape[-1],)  # (B, L, H, m): broadcast over the batch, no copy per layer
            return (jnp.concatenate([q, jnp.broadcast_to(qp.astype(q.dtype), shape)], axis=-1),
                    jnp.concatenate([k, jnp.broadcast_to(kp.astype(k.dtype), shape)], axis=-1))

        bias = None
        if self.relative:
            bias = self.rel(length, offset).logit_bias
            if s.has_cls:  # the [CLS] row is a constant shift: exactly zero gradient, as in the bias form
                bias = jnp.concatenate([jax.lax.stop_gradient(bias[:, :, :1]), bias[:, :, 1:]], axis=2)
            bias = bias.astype(jnp.float32)
        return PositionalTerms(qk_transform=concat_heads, logit_bias=bias, logit_scale=tupe_scale(s))


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
        check_table_length(offset + length, s.max_len)
        qp, kp = PositionProjections(s, rows=s.max_len, name="proj")(offset, length)

        def add_positions(q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
            return (q + qp[None].astype(q.dtype)), (k + kp[None].astype(k.dtype))

        return PositionalTerms(qk_transform=add_positions, logit_scale=(4 * s.head_dim) ** -0.5)
