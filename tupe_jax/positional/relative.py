"""`t5`: bucketed relative position bias (Raffel et al., 2020), one table shared by all layers.

For query i and key j, with relative position r = j − i, a learned scalar per (bucket, head) is added to the
logits:   logit_ij += b[bucket(r), h],   b ∈ R^{num_buckets × H} (N(0, 0.02)), computed once per forward.

bucket(r), with B = num_buckets, D = max_distance:
- bidirectional: B ← B/2 per direction; keys to the right (r > 0) add B; n = |r|.
- causal: n = max(−r, 0) (the future is masked anyway).
- with e = B/2 exact buckets: n < e → bucket n; otherwise
      e + ⌊ log(n/e) / log(D/e) · (B − e) ⌋, clipped to B − 1.
Defaults B = 32, D = 128: the bidirectional form has 8 exact buckets per side and saturates at distance 91; the
causal form has 16 exact buckets and saturates at 113 (integer truncation; not at 128).

`untie_cls` (TUPE-R, as the official TUPE code does it): the table gets one extra row; the [CLS] row (index 0 →
all keys, incl. the corner) uses bucket B/2 (right side, distance 0, which never occurs otherwise), and the
[CLS] column (other queries → index 0) uses the extra bucket B. So [CLS] has its own buckets in both directions
rather than real distances. Not scaled by 1/√d_h. Any length is accepted.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tupe_jax.positional.base import PositionalSettings, PositionalTerms, normal_init, standard_scale


def relative_position_bucket(relative_position: jax.Array, bidirectional: bool, num_buckets: int = 32,
                             max_distance: int = 128) -> jax.Array:
    """Map r = key − query to a bucket id in [0, num_buckets)."""
    bucket = jnp.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (relative_position > 0).astype(relative_position.dtype) * num_buckets
        n = jnp.abs(relative_position)
    else:
        n = jnp.maximum(-relative_position, 0)
    max_exact = num_buckets // 2
    n_safe = jnp.maximum(n, 1).astype(jnp.float32)
    large = max_exact + (jnp.log(n_safe / max_exact) / np.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).astype(relative_position.dtype)
    large = jnp.minimum(large, num_buckets - 1)
    return bucket + jnp.where(n < max_exact, n, large)


def bucket_grid(length: int, bidirectional: bool, num_buckets: int, max_distance: int,
                untie_cls: bool) -> jax.Array:
    """(L, L) bucket ids for query i (rows) and key j (columns)."""
    pos = jnp.arange(length, dtype=jnp.int32)
    grid = relative_position_bucket(pos[None, :] - pos[:, None], bidirectional, num_buckets, max_distance)
    if untie_cls:
        grid = grid.at[:, 0].set(num_buckets)        # others -> [CLS]: the extra bucket
        grid = grid.at[0, :].set(num_buckets // 2)   # [CLS] -> all: the unused right-side distance-0 bucket
    return grid


class RelativeBias(nn.Module):
    settings: PositionalSettings
    untie_cls: bool = False   # set by TUPE-R; plain `t5`/`bert_r` use real distances for [CLS] too

    @nn.compact
    def __call__(self, length: int, offset: int = 0) -> PositionalTerms:
        s = self.settings
        rows = s.rel_num_buckets + (1 if self.untie_cls else 0)
        table = self.param("rel_bias", normal_init(0.02, ("buckets", "heads")), (rows, s.num_heads), jnp.float32)
        grid = bucket_grid(length, not s.causal, s.rel_num_buckets, s.rel_max_distance, self.untie_cls)
        bias = jnp.transpose(nn.meta.unbox(table)[grid], (2, 0, 1))[None]  # (1, H, L, L)
        return PositionalTerms(logit_bias=bias.astype(jnp.float32), logit_scale=standard_scale(s))
