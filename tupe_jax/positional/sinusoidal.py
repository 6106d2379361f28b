"""`sinusoidal`: Vaswani et al. (2017) fixed sin/cos vectors added at the input.

    PE(t, 2i)   = sin(t / 10000^(2i/d))
    PE(t, 2i+1) = cos(t / 10000^(2i/d)),      i = 0 … d/2 − 1

Ordering: INTERLEAVED as in the paper (even features sin, odd features cos), not the [sin | cos] concatenation
of tensor2tensor/fairseq; the two differ by a fixed permutation of features. Computed in float32 for any
length, then cast to the compute dtype. No parameters; any length is accepted.

Scale: what is added is `AMPLITUDE · PE` with AMPLITUDE = 0.02·√2, so its per-feature RMS (PE's is 1/√2) equals
the std of our N(0, 0.02) token embeddings. Vaswani et al. keep the two at a similar scale by multiplying
N(0, d^-1/2) embeddings by √d; added raw to BERT-initialised embeddings, PE would be ~35× larger than the token
signal and the model would see mostly positions (a tiny causal LM then stalls near the unigram loss).

`model.sinusoidal_style`:
  'scaled'  (default) the interleaved table above times AMPLITUDE, positions 0, 1, 2, ...
  'fairseq' fairseq's `SinusoidalPositionalEmbedding` table, the baseline of the NoPos and ALiBi papers:
            with h = d/2 and w_i = exp(−i · ln(10000)/(h − 1)), i = 0 … h−1,
                PE(t) = [sin(t·w_0) … sin(t·w_{h−1}) | cos(t·w_0) … cos(t·w_{h−1})]      (halves, not interleaved)
            amplitude 1, and positions counted from padding_idx + 1 = 2 (fairseq's padding_idx is 1), so the
            first token gets PE(2). fairseq multiplies its N(0, d^-1/2) token embeddings by √d before adding
            this; our token embeddings are BERT's N(0, 0.02) without that factor, so here the positions are
            ~35x the token signal. The default stays 'scaled' because it trains better here:
            docs/experiments/sinusoidal/ (causal, 2 layers, d 128, 3.1M tokens, seeds 0-2: fairseq's table
            ends 1.61 ± 0.15 nats worse in validation loss, worse in every seed).
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from tupe_jax.positional.base import PositionalSettings, PositionalTerms, standard_scale


def sinusoid_table(positions: jnp.ndarray, dim: int) -> jnp.ndarray:
    """(L,) positions -> (L, dim) float32 table with interleaved sin/cos."""
    if dim % 2:
        raise ValueError(f"sinusoidal encoding needs an even hidden size, got {dim}")
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(positions.shape[0], dim)


AMPLITUDE = 0.02 * math.sqrt(2.0)  # RMS of AMPLITUDE·PE = 0.02 = the token-embedding init std
SINUSOIDAL_STYLES = ("scaled", "fairseq")
FAIRSEQ_PADDING_IDX = 1             # fairseq's dictionary: <s>=0, <pad>=1; positions start at padding_idx + 1


def fairseq_sinusoid_table(positions: jnp.ndarray, dim: int) -> jnp.ndarray:
    """(L,) positions -> (L, dim) float32 table in fairseq's layout: [sin | cos] halves, w_i = 10000^(−i/(h−1))."""
    if dim % 2 or dim < 4:
        raise ValueError(f"fairseq sinusoidal encoding needs an even hidden size >= 4, got {dim}")
    half = dim // 2
    inv_freq = np.exp(np.arange(half, dtype=np.float64) * -(math.log(10000.0) / (half - 1)))
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class Sinusoidal(nn.Module):
    settings: PositionalSettings

    def __call__(self, length: int, offset: int = 0) -> PositionalTerms:
        s = self.settings
        if s.sinusoidal_style == "fairseq":
            positions = jnp.arange(length) + offset + FAIRSEQ_PADDING_IDX + 1
            table = fairseq_sinusoid_table(positions, s.hidden_size)
        else:
            table = AMPLITUDE * sinusoid_table(jnp.arange(length) + offset, s.hidden_size)
        return PositionalTerms(input_vector=table.astype(s.dtype), logit_scale=standard_scale(s))
