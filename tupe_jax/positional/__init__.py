"""Positional schemes, one small Linen module each, all acting through `base.PositionalTerms`.

`make_positional(name, settings)` builds the module for a user-facing name (`--config.model.pe=`).
"""
from __future__ import annotations

import flax.linen as nn

from tupe_jax.errors import UserError
from tupe_jax.positional.alibi import ALiBi, alibi_bias, alibi_slopes
from tupe_jax.positional.base import NoPos, PositionalSettings, PositionalTerms
from tupe_jax.positional.learned import LearnedAbsolute
from tupe_jax.positional.relative import RelativeBias, bucket_grid, relative_position_bucket
from tupe_jax.positional.rope import Rotary, apply_rope, rope_angles
from tupe_jax.positional.sinusoidal import Sinusoidal, sinusoid_table
from tupe_jax.positional.tupe import DisentangledAbsolute, UntiedPositional

SCHEMES = ("bert_a", "sinusoidal", "rope", "alibi", "t5", "bert_r", "nopos", "tupe_a", "tupe_r", "bert_ad")
ALIASES = {"learned": "bert_a"}
# Schemes whose learned position table bounds the input length.
TABLE_SCHEMES = ("bert_a", "bert_r", "tupe_a", "tupe_r", "bert_ad")


def canonical_name(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in SCHEMES:
        raise UserError(f"unknown positional scheme '{name}'", "model.pe",
                        f"use one of {', '.join(SCHEMES)} (or the alias 'learned')")
    return name


class BertR(nn.Module):
    """`bert_r`: the TUPE paper's BERT-R baseline = learned absolute input (`bert_a`) + T5 relative bias.

        h_t^0 = E[w_t] + P[t];   logit_ij = (h_i W^Q)·(h_j W^K)/√d_h + b_{bucket(j−i), h}
    """

    settings: PositionalSettings

    @nn.compact
    def __call__(self, length: int, offset: int = 0) -> PositionalTerms:
        absolute = LearnedAbsolute(self.settings, name="absolute")(length, offset)
        return absolute.merge(RelativeBias(self.settings, name="relative")(length, offset))


def make_positional(name: str, settings: PositionalSettings, module_name: str = "positional") -> nn.Module:
    """The Linen module of scheme `name` (aliases accepted)."""
    name = canonical_name(name)
    builders = {
        "bert_a": lambda: LearnedAbsolute(settings, name=module_name),
        "sinusoidal": lambda: Sinusoidal(settings, name=module_name),
        "rope": lambda: Rotary(settings, name=module_name),
        "alibi": lambda: ALiBi(settings, name=module_name),
        "t5": lambda: RelativeBias(settings, name=module_name),
        "bert_r": lambda: BertR(settings, name=module_name),
        "nopos": lambda: NoPos(settings, name=module_name),
        "tupe_a": lambda: UntiedPositional(settings, relative=False, form=settings.tupe_form, name=module_name),
        "tupe_r": lambda: UntiedPositional(settings, relative=True, form=settings.tupe_form, name=module_name),
        "bert_ad": lambda: DisentangledAbsolute(settings, name=module_name),
    }
    return builders[name]()


__all__ = [
    "SCHEMES", "ALIASES", "TABLE_SCHEMES", "canonical_name", "make_positional", "PositionalSettings",
    "PositionalTerms", "NoPos", "LearnedAbsolute", "Sinusoidal", "Rotary", "ALiBi", "RelativeBias", "BertR",
    "UntiedPositional", "DisentangledAbsolute", "alibi_slopes", "alibi_bias", "relative_position_bucket",
    "bucket_grid", "apply_rope", "rope_angles", "sinusoid_table",
]
