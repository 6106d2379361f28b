"""`alibi`: attention with linear biases (Press, Smith, Lewis, ICLR 2022).

No position vectors anywhere; every layer adds a fixed per-head penalty proportional to distance:

    causal:         bias_h(i, j) = −m_h · (i − j)        (j ≤ i; the future is masked anyway)
    bidirectional:  bias_h(i, j) = −m_h · |i − j|

The bias is NOT multiplied by 1/√d_h (the q·k term is). Slopes for n = 2^k heads form the geometric sequence
m_h = 2^(−8h/n), h = 1 … n. For other n (the official construction): with c = 2^⌊log2 n⌋, take the c slopes
for c heads, then append the first n − c of every other slope (1st, 3rd, 5th, …) of the 2c-head sequence.
Slopes and the bias are float32. No parameters; any length is accepted.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from tupe_jax.positional.base import PositionalSettings, PositionalTerms, standard_scale


def alibi_slopes(num_heads: int) -> np.ndarray:
    """Per-head slopes m_h, float32, shape (num_heads,)."""

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    c = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(c)
    if c < num_heads:
        slopes += power_of_two(2 * c)[0::2][: num_heads - c]
    return np.asarray(slopes, dtype=np.float32)


def alibi_bias(length: int, num_heads: int, causal: bool) -> jnp.ndarray:
    """(1, H, L, L) float32 bias."""
    pos = jnp.arange(length)
    diff = (pos[:, None] - pos[None, :]).astype(jnp.float32)  # i − j
    distance = diff if causal else jnp.abs(diff)
    slopes = jnp.asarray(alibi_slopes(num_heads))
    return (-slopes[:, None, None] * distance[None])[None]


class ALiBi(nn.Module):
    settings: PositionalSettings

    def __call__(self, length: int, offset: int = 0) -> PositionalTerms:
        # Depends on i − j only, so the offset cancels.
        s = self.settings
        # Causal: −m·(i − j) = m·j − m·i on the allowed keys j ≤ i, the per-key form that `key_slopes` announces.
        return PositionalTerms(logit_bias=alibi_bias(length, s.num_heads, s.causal), logit_scale=standard_scale(s),
                               key_slopes=jnp.asarray(alibi_slopes(s.num_heads), jnp.float32) if s.causal else None)
