"""The positional-scheme protocol shared by every scheme.

A scheme acts on the Transformer at four points and only these:

1. **input**       a vector p_t added to the token embedding x_t            -> `input_vector` (L, d)
2. **q/k transform** a function applied to queries and keys in every layer  -> `qk_transform(q, k)`
3. **logit bias**  an additive (1, H, Lq, Lk) term, computed once per forward
                   and shared by every layer                                 -> `logit_bias`
4. **logit scale** the factor on q·k: 1/√d_h normally, 1/√(2·d_h) for TUPE   -> `logit_scale`

Each scheme is a Linen module called ONCE at the top of a forward pass as `scheme(length, offset)`; it returns
a `PositionalTerms` that the model threads through its layers. Nothing positional happens anywhere else. A
scheme's parameters get AdamW's weight decay unless their name contains `bias` or is `scale`, or their module is
a norm (`optim.decays`):
name a parameter accordingly when decay would pull it somewhere it should not go. Adding a scheme: the README's
steps under "Layout".
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import flax.linen as nn

from tupe_jax.errors import UserError

Array = jax.Array
QKTransform = Callable[[Array, Array], tuple[Array, Array]]


@dataclasses.dataclass(frozen=True)
class PositionalSettings:
    """Everything a scheme may need to know about the model it sits in."""

    hidden_size: int
    num_heads: int
    max_len: int
    causal: bool = False
    untie_cls: bool = True          # TUPE only; forced off in causal models (there is no [CLS]).
    rope_base: float = 10000.0
    rope_style: str = "half"         # 'half' (GPT-NeoX/LLaMA) or 'interleaved' (RoFormer/GPT-J)
    rope_fraction: float = 1.0       # fraction of d_h that is rotated
    rel_num_buckets: int = 32
    rel_max_distance: int = 128
    layer_norm_eps: float = 1e-5
    tupe_form: str = "bias"          # TUPE only: position term as a logit 'bias' or as 'concat'enated heads
    sinusoidal_style: str = "scaled"  # sinusoidal only: 'scaled' (ours) or 'fairseq' (sinusoidal.py)
    dtype: jnp.dtype = jnp.float32   # compute dtype; biases, angles and slopes stay float32

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def has_cls(self) -> bool:
        """Whether index 0 is an untied [CLS] (encoder with untie_cls on)."""
        return self.untie_cls and not self.causal


@dataclasses.dataclass(frozen=True)
class PositionalTerms:
    """What a scheme hands the model for one forward pass (any field may be absent)."""

    input_vector: Optional[Array] = None       # (L, d), added to token embeddings
    qk_transform: Optional[QKTransform] = None  # (B, L, H, d_h) x2 -> same, in every layer
    logit_bias: Optional[Array] = None         # (1, H, L, L) float32, shared by every layer
    logit_scale: float = 1.0                   # multiplies q·k (not the bias)
    # (H,) float32 m_h, set only where logit_bias_h[i, j] = m_h·j + (a constant per row) on every key a causal mask
    # allows (causal ALiBi: −m_h·(i − j)); a fused kernel that would round the bias may use m_h·j instead
    # (`attention.cudnn_inputs`), which softmax cannot tell apart.
    key_slopes: Optional[Array] = None

    def merge(self, other: "PositionalTerms") -> "PositionalTerms":
        """Combine two schemes (e.g. BERT-R = learned input + T5 bias); the scale must agree. `key_slopes`
        survives only where the other scheme adds no bias (the sum is no longer m_h·j otherwise)."""
        if self.logit_scale != other.logit_scale:
            raise ValueError("cannot merge positional terms with different logit scales")
        key_slopes = other.key_slopes if self.logit_bias is None else \
            self.key_slopes if other.logit_bias is None else None
        return PositionalTerms(
            input_vector=_add(self.input_vector, other.input_vector),
            qk_transform=_compose(self.qk_transform, other.qk_transform),
            logit_bias=_add(self.logit_bias, other.logit_bias),
            logit_scale=self.logit_scale,
            key_slopes=key_slopes,
        )


def _add(a, b):
    if a is None:
        return b
    return a if b is None else a + b


def _compose(f, g):
    if f is None:
        return g
    if g is None:
        return f
    return lambda q, k: g(*f(q, k))


def standard_scale(settings: PositionalSettings) -> float:
    """1/√d_h, the usual scaled-dot-product factor."""
    return settings.head_dim ** -0.5


def check_table_length(needed: int, max_len: int) -> None:
    """Learned tables never clamp: an input longer than the table's `max_len` positions is an error (a TUPE MLM
    table has one more row, [CLS]'s, which is not a position)."""
    if needed > max_len:
        raise UserError(
            f"input needs {needed} positions but the learned position table covers {max_len} (model.max_len)",
            "model.max_len",
            "raise --config.model.max_len (and retrain) or use a scheme without a table "
            "(sinusoidal, rope, alibi, t5, nopos)",
        )


def normal_init(stddev: float, names: tuple[Optional[str], ...]):
    """N(0, stddev) initializer carrying logical axis names for sharding."""
    return nn.with_logical_partitioning(nn.initializers.normal(stddev), names)


class NoPos(nn.Module):
    """`nopos`: no positional information at all (Haviv et al., 2022).

    logit_ij = (x_i W^Q)·(x_j W^K) / √d_h.  A causal decoder can still infer absolute position from the mask;
    a bidirectional encoder is permutation-equivariant and cannot.
    """

    settings: PositionalSettings

    def __call__(self, length: int, offset: int = 0) -> PositionalTerms:
        return PositionalTerms(logit_scale=standard_scale(self.settings))
