"""`rope`: rotary position embedding (Su et al., RoFormer, 2021), applied to q and k in every layer.

For the first r = 2·⌊fraction·d_h/2⌋ features of each head, split into r/2 planes, plane i at position m is
rotated by the angle m·θ_i with

    θ_i = base^(−2i/r),   i = 0 … r/2 − 1      (base = 10000; r = d_h when fraction = 1)

    [q'_a]   [cos mθ_i  −sin mθ_i] [q_a]
    [q'_b] = [sin mθ_i   cos mθ_i] [q_b]

so q'_m·k'_n depends on m and n only through n − m. Remaining d_h − r features pass through unchanged
(GPT-NeoX `rotary_pct`). Pairing conventions:

- `half` (GPT-NeoX / LLaMA): plane i pairs features (i, i + r/2);
- `interleaved` (RoFormer / GPT-J): plane i pairs features (2i, 2i+1).

They differ by a fixed permutation of the rotated features. Angles, cos and sin are computed in float32 even
when the compute dtype is bfloat16 (bf16 phases are wrong by radians at positions in the thousands); the
rotation runs in float32 and the result is cast back. No parameters; any length is accepted.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tupe_jax.positional.base import PositionalSettings, PositionalTerms, standard_scale


def rotated_count(head_dim: int, fraction: float) -> int:
    """head_dim · fraction truncated to an integer, after rounding off float error (100 · 0.58 is 57.99999999999999
    in floats: 58 features, not 57)."""
    return int(round(head_dim * fraction, 9))


def rotary_dim(head_dim: int, fraction: float) -> int:
    """Number of rotated features per head (even): `rotated_count` rounded down to even."""
    return 2 * (rotated_count(head_dim, fraction) // 2)


def rope_angles(positions: jax.Array, rot_dim: int, base: float) -> tuple[jax.Array, jax.Array]:
    """(L,) positions -> cos, sin of shape (L, rot_dim/2), float32."""
    inv_freq = base ** (-np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    return jnp.cos(angles), jnp.sin(angles)


ROPE_STYLES = ("half", "interleaved")


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, style: str) -> jax.Array:
    """Rotate x of shape (B, L, H, d_h) with per-position cos/sin of shape (L, r/2)."""
    rot = 2 * cos.shape[-1]
    x32 = x.astype(jnp.float32)
    xr, passthrough = x32[..., :rot], x32[..., rot:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    if style == "half":
        a, b = xr[..., : rot // 2], xr[..., rot // 2:]
        rotated = jnp.concatenate([a * c - b * s, b * c + a * s], axis=-1)
    elif style == "interleaved":
        a, b = xr[..., 0::2], xr[..., 1::2]
        rotated = jnp.stack([a * c - b * s, b * c + a * s], axis=-1).reshape(xr.shape)
    else:
        raise ValueError(f"unknown rope_style {style!r}; use 'half' or 'interleaved'")
    return jnp.concatenate([rotated, passthrough], axis=-1).astype(x.dtype)


class Rotary(nn.Module):
    settings: PositionalSettings

    def __call__(self, length: int, offset: int = 0) -> PositionalTerms:
        s = self.settings
        rot = rotary_dim(s.head_dim, s.rope_fraction)
        if rot == 0:
            raise ValueError(f"rope_fraction={s.rope_fraction} rotates no feature of a {s.head_dim}-dim head")
        cos, sin = rope_angles(jnp.arange(length) + offset, rot, s.rope_base)
        rotate = functools.partial(apply_rope, cos=cos, sin=sin, style=s.rope_style)
        return PositionalTerms(qk_transform=lambda q, k: (rotate(q), rotate(k)), logit_scale=standard_scale(s))
