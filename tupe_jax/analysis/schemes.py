"""The (scheme, seed) grid of a comparison suite: names, parsing and per-run configs (no training here).

    Scheme                                one positional scheme: pe, objective, tied [CLS]; `.name` 'tupe_a-mlm-tiedcls'
    parse_schemes(config) -> [Scheme]     `config.schemes` ("tupe_a-tiedcls,nopos-mlm,...") as Schemes
    parse_seeds(config) -> [int]          `config.seeds` ("0,1,2")
    scheme_config(config, scheme, seed)   the pretraining config of one (scheme, seed) (configs/pretrain.py's layout)
    run_name(scheme, seed)                '<scheme.name>-s<seed>': the run's folder name
"""
from __future__ import annotations

import dataclasses
import os

import ml_collections

from tupe_jax import config as config_lib
from tupe_jax.errors import require
from tupe_jax.model import OBJECTIVES
from tupe_jax.positional import ALIASES, SCHEMES

SECTIONS = ("model", "data", "train", "mesh", "checkpoint", "metrics")   # shared by every run of a suite


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One positional scheme of a suite: the `pe`, the objective, (TUPE) whether [CLS] is untied, and (sinusoidal)
    whether the table is fairseq's (model.sinusoidal_style)."""
    pe: str
    objective: str
    tied_cls: bool = False
    fairseq: bool = False

    @property
    def name(self) -> str:
        return (f"{self.pe}-{self.objective}" + ("-tiedcls" if self.tied_cls else "")
                + ("-fairseq" if self.fairseq else ""))

    @property
    def label(self) -> str:
        """Short name for tables: 'tupe_a (tied [CLS])', 'sinusoidal (fairseq)'."""
        extra = [e for e, on in (("tied [CLS]", self.tied_cls), ("fairseq", self.fairseq)) if on]
        return self.pe + (f" ({', '.join(extra)})" if extra else "")


def parse_schemes(config: ml_collections.ConfigDict) -> list[Scheme]:
    """`config.schemes` → Schemes; raises UserError naming a bad entry."""
    where = "--config.schemes"
    default = str(config.objective)
    config_lib.require_one_of(default, OBJECTIVES, "objective")
    schemes: list[Scheme] = []
    for item in (s.strip() for s in str(config.schemes).split(",")):
        if not item:
            continue
        pe, *suffixes = item.split("-")
        pe = ALIASES.get(pe, pe)
        require(pe in SCHEMES, f"unknown positional scheme {pe!r} in schemes", where,
                "use <pe>[-mlm|-clm][-tiedcls|-fairseq] with pe one of " + "|".join(SCHEMES))
        objective, tied, fairseq = default, False, False
        twice = [x for x in suffixes if suffixes.count(x) > 1] + (["mlm/-clm"] if {"mlm", "clm"} <= set(suffixes)
                                                                    else [])
        require(not twice, f"{item!r} gives -{twice[0] if twice else ''} twice or both", where,
                "give each suffix once: <pe>[-mlm|-clm][-tiedcls|-fairseq]")
        for suffix in suffixes:
            require(suffix in ("mlm", "clm", "tiedcls", "fairseq"), f"unknown scheme suffix -{suffix} in {item!r}",
                    where, "use -mlm, -clm, -tiedcls or -fairseq")
            if suffix == "tiedcls":
                tied = True
            elif suffix == "fairseq":
                fairseq = True
            else:
                objective = suffix
        require(not (tied and objective == "clm"), f"{item!r}: -tiedcls needs an MLM ([CLS]) model", where,
                "drop -tiedcls or add -mlm")
        require(not fairseq or pe == "sinusoidal", f"{item!r}: -fairseq is a sinusoidal table style", where,
                "use it as sinusoidal-fairseq")
        scheme = Scheme(pe, objective, tied, fairseq)
        require(scheme not in schemes, f"scheme {item!r} is listed twice", where, "list each scheme once")
        schemes.append(scheme)
    require(bool(schemes), "no schemes given", where, "write e.g. --config.schemes=bert_a,alibi")
    return schemes


def parse_seeds(config: ml_collections.ConfigDict) -> list[int]:
    """`config.seeds` ("0,1,2") -> [0, 1, 2]; raises UserError naming a bad entry."""
    where, out = "--config.seeds", []
    for item in (x.strip() for x in str(config.seeds).split(",")):
        if not item:
            continue
        require(item.isdecimal() and int(item) < config_lib.SEED_LIMIT,
                f"seed {item!r} in seeds is not an integer in [0, 2**32)", where,
                "write e.g. 0,1,2 (JAX keys keep 32 bits of a seed)")
        require(int(item) not in out, f"seed {item} is listed twice in seeds", where, "list each seed once")
        out.append(int(item))
    require(bool(out), "no seeds given", where, "write e.g. --config.seeds=0,1,2")
    return out


def scheme_config(config: ml_collections.ConfigDict, scheme: Scheme, seed: int) -> ml_collections.ConfigDict:
    """The pretraining config of (`scheme`, `seed`): the suite's shared sections, with pe / objective / untie_cls
    and train.seed set."""
    sub = ml_collections.ConfigDict({s: config[s].to_dict() for s in SECTIONS if s in config})
    sub.model.pe, sub.model.objective = scheme.pe, scheme.objective
    sub.model.untie_cls = scheme.objective == "mlm" and not scheme.tied_cls
    sub.model.sinusoidal_style = "fairseq" if scheme.fairseq else "scaled"
    sub.train.seed = int(seed)
    return config_lib.lock(sub)


def run_name(scheme: Scheme, seed: int) -> str:
    return f"{scheme.name}-s{seed}"


def run_path(root: str, scheme: Scheme, seed: int) -> str:
    """The absolute path of (scheme, seed)'s pretraining run under `root` (Orbax wants absolute paths)."""
    return os.path.abspath(os.path.join(root, run_name(scheme, seed)))
