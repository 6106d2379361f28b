"""Positional schemes, one small Linen module each, all acting through `base.PositionalTerms`.

`make_positional(name, settings)` builds the module for a user-facing name (`--config.model.pe=`). The scheme,
rope-style and TUPE-form names live here and nowhere else; `validate_config(model)` checks the positional keys of a
`config.model` section (called by `model.validate_config`).
"""
from __future__ import annotations

import flax.linen as nn

from tupe_jax.errors import UserError, require
from tupe_jax.positional.alibi import ALiBi, alibi_bias, alibi_slopes
from tupe_jax.positional.base import NoPos, PositionalSettings, PositionalTerms
from tupe_jax.positional.learned import LearnedAbsolute
from tupe_jax.positional.relative import RelativeBias, bucket_grid, relative_position_bucket
from tupe_jax.positional.rope import ROPE_STYLES, Rotary, apply_rope, rope_angles, rotated_count
from tupe_jax.positional.sinusoidal import SINUSOIDAL_STYLES, Sinusoidal, fairseq_sinusoid_table, sinusoid_table
from tupe_jax.positional.tupe import TUPE_FORMS, DisentangledAbsolute, UntiedPositional

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


def _one_of(value, known: tuple[str, ...], key: str) -> None:
    require(value in known, f"unknown {key} {value!r}", f"--config.{key}", "use one of " + "|".join(known))


def validate_config(model) -> None:
    """Check the positional keys of a `config.model` section; raise UserError naming the key."""
    _one_of(ALIASES.get(model.pe, model.pe), SCHEMES, "model.pe")
    _one_of(model.rope_style, ROPE_STYLES, "model.rope_style")
    _one_of(model.tupe_form, TUPE_FORMS, "model.tupe_form")
    _one_of(model.get("sinusoidal_style", "scaled"), SINUSOIDAL_STYLES, "model.sinusoidal_style")
    require(0.0 < model.rope_fraction <= 1.0, f"model.rope_fraction = {model.rope_fraction} is outside (0, 1]",
            "--config.model.rope_fraction", "give a fraction in (0, 1]")
    head_dim = model.hidden_size // model.num_heads
    rotary = rotated_count(head_dim, model.rope_fraction)
    require(model.pe != "rope" or (rotary >= 2 and rotary % 2 == 0),
            f"rope rotates {rotary} of {head_dim} head dims, which must be even and >= 2",
            "--config.model.rope_fraction", "pick a fraction giving an even number of dims")
    require(model.rel_num_buckets >= 4 and model.rel_num_buckets % 2 == 0,
            f"model.rel_num_buckets = {model.rel_num_buckets} must be even and >= 4", "--config.model.rel_num_buckets",
            "use e.g. 32")
    require(model.rel_max_distance > model.rel_num_buckets // 2,
            f"model.rel_max_distance = {model.rel_max_distance} must exceed rel_num_buckets/2 = "
            f"{model.rel_num_buckets // 2} (the exact-distance buckets)", "--config.model.rel_max_distance",
            "use e.g. 128 with 32 buckets")


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
    "SCHEMES", "ALIASES", "TABLE_SCHEMES", "ROPE_STYLES", "TUPE_FORMS", "canonical_name", "make_positional",
    "validate_config", "PositionalSettings",
    "PositionalTerms", "NoPos", "LearnedAbsolute", "Sinusoidal", "Rotary", "ALiBi", "RelativeBias", "BertR",
    "UntiedPositional", "DisentangledAbsolute", "alibi_slopes", "alibi_bias", "relative_position_bucket",
    "bucket_grid", "apply_rope", "rope_angles", "sinusoid_table", "fairseq_sinusoid_table", "SINUSOIDAL_STYLES",
]
