"""`bert_a` (alias `learned`): a learned absolute position table added at the input (BERT, GPT-2).

    h_t^0 = E[w_t] + P[t],          P ∈ R^{max_len × d},  P ~ N(0, 0.02)
    logit_ij = (h_i W^Q)·(h_j W^K) / √d_h

Positions beyond the table are an error, never clamped.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from tupe_jax.positional.base import (PositionalSettings, PositionalTerms, check_table_length, normal_init,
                                      standard_scale)


class LearnedAbsolute(nn.Module):
    settings: PositionalSettings

    @nn.compact
    def __call__(self, length: int, offset: int = 0) -> PositionalTerms:
        s = self.settings
        check_table_length(offset + length, s.max_len)
        table = self.param("table", normal_init(0.02, ("pos", "embed")), (s.max_len, s.hidden_size), jnp.float32)
        rows = nn.meta.unbox(table)[offset:offset + length]
        return PositionalTerms(input_vector=rows.astype(s.dtype), logit_scale=standard_scale(s))
