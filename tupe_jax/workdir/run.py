"""A finished (or running) run loaded for evaluation, fine-tuning and every analysis: `LoadedRun`, `load_run`."""
from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from tupe_jax import checkpoint as ckpt_lib
from tupe_jax.config import apply_overrides
from tupe_jax.data.prepared import prepared_tokenizer
from tupe_jax.data.sources import check_source
from tupe_jax.data.tokenizer import get_tokenizer
from tupe_jax.errors import UserError, require
from tupe_jax.model import ModelConfig, TransformerLM
from tupe_jax.positional import TABLE_SCHEMES, canonical_name
from tupe_jax.workdir.gate import finetune_kind, folder_kind, read_config, tokenizer_path
from tupe_jax.workdir.meta import check_tokenizer, read_kept_step, read_meta


# ================================================================================================ loading a run
@dataclasses.dataclass
class LoadedRun:
    """One trained (or freshly initialised) model and what it was trained with; tests build them in memory."""

    config: Any                 # the run's config (ml_collections; `config.data` for the analyses' text)
    model_cfg: ModelConfig
    params: Any                 # unboxed, on the default device
    tokenizer: Any
    step: Optional[int] = None
    workdir: str = ""
    corpus: Mapping[str, str] = dataclasses.field(default_factory=dict)   # data overrides read with it (`with_corpus`)

    @property
    def name(self) -> str:
        base = str(self.workdir).rstrip("/").rsplit("/", 1)[-1] if self.workdir else ""
        return base or f"{self.model_cfg.pe}-{self.model_cfg.objective}"

    @property
    def pe(self) -> str:
        return canonical_name(self.model_cfg.pe)

    @property
    def has_table(self) -> bool:
        """Whether a learned position table bounds the input length (max_len)."""
        return self.pe in TABLE_SCHEMES

    def describe(self) -> dict:
        c = self.model_cfg
        return {"name": self.name, "workdir": self.workdir, "step": self.step, "pe": self.pe,
                "objective": c.objective, "max_len": c.max_len, "num_layers": c.num_layers,
                "hidden_size": c.hidden_size, "num_heads": c.num_heads,
                **({"corpus": {k: str(v) for k, v in self.corpus.items()}} if self.corpus else {})}


def load_run(workdir: str, step: Optional[int] = None, data: Optional[Mapping[str, str]] = None) -> LoadedRun:
    """A finished (or running) pretraining run's config, params (default device), tokenizer and step; with `data`
    (`{"data.path": ..., ...}`), its config names that corpus instead of its own (`with_corpus`)."""
    config = read_config(workdir)
    if "task" in config:
        raise UserError(f"{workdir} is {finetune_kind(workdir, config)}; this command reads a pretraining run",
                        "--workdir", "point it at the run given as init_from, or at a `launch pretrain` workdir")
    if folder_kind(config) != "a pretraining run":
        raise UserError(f"{workdir} holds {folder_kind(config)}; this command reads a pretraining run", "--workdir",
                        "point it at one of the suite's runs (<runs_dir>/<scheme>-s<seed>/)" if "suite" in config
                        else "point it at a `launch pretrain` workdir")
    scored = with_corpus(config, data) if data else config    # a bad --config.data.* stops before the restore
    cfg = ModelConfig.from_config(config.model)
    if cfg.attention_backend == "cudnn" and jax.default_backend() != "gpu":   # trained on a GPU, read elsewhere
        print(f"{workdir}: attention_backend=cudnn needs a GPU; reading it with xla (the same maths)", flush=True)
        cfg = dataclasses.replace(cfg, attention_backend="xla")
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])   # this process's: any process count
    tokens = jnp.zeros((1, min(cfg.max_len, 8)), jnp.int32)     # a learned table may have fewer than 8 rows
    abstract = jax.eval_shape(lambda: TransformerLM(cfg).init({"params": jax.random.PRNGKey(0)}, tokens)["params"])
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                                      nn.meta.unbox(abstract))

    def read(at: int) -> tuple[dict, Any]:
        meta = read_meta(workdir, at)
        saved, ours = meta.get("param_shapes") or {}, ckpt_lib.param_shapes(abstract)
        wrong = next((k for k in sorted(set(saved) | set(ours)) if saved.get(k) != ours.get(k)), None)
        if saved and wrong is not None:
            raise UserError(f"{workdir}/config.json does not match its checkpoint step {at}: param {wrong} has "
                            f"shape {saved.get(wrong)} there but {ours.get(wrong)} from config.json (was it edited?)",
                            "--workdir", "restore the run's config.json")
        return meta, ckpt_lib.restore_params(workdir, at, abstract)

    step, (meta, params) = read_kept_step(workdir, step, read, follow=step is None)
    if meta.get("fresh_mlm_head"):          # an import without one (interop/hf.py)
        print(f"note: {workdir}: its MLM head was initialised at import (the checkpoint had none): its MLM losses "
              "and accuracies mean nothing until it is trained", flush=True)
    tokenizer = get_tokenizer(config, workdir)
    check_tokenizer(meta, tokenizer.fingerprint, tokenizer_path(workdir))
    if data and scored.data.get("name", "") == "prepared":    # the run's tokenizer reads the records' ids
        require(prepared_tokenizer(scored, None).fingerprint == tokenizer.fingerprint,
                f"{scored.data.path} was prepared with another tokenizer than the run's ({workdir})",
                "--config.data.path", f"prepare the corpus with --config.data.vocab_file={tokenizer_path(workdir)} "
                "into a fresh directory")
    return LoadedRun(scored, cfg, params, tokenizer, step, str(workdir), dict(data or {}))


def with_corpus(config: Any, data: Mapping[str, str]) -> Any:
    """A copy of the run's `config` whose `data` section names another corpus: `data` holds `--config.data.*`
    overrides, checked against the section's keys and types (`load_run` reads the corpus with the run's own
    tokenizer; a prepared directory must have been made with it)."""
    config = copy.deepcopy(config)
    apply_overrides(config, data)
    check_source(config.data)
    return config


def load_runs(workdirs: str | list[str], step: Optional[int] = None,
              data: Optional[Mapping[str, str]] = None) -> list[LoadedRun]:
    """`load_run` for each workdir; refused before loading: a run given twice, or two runs of one folder name (the
    analyses name their outputs and rows by it, so one would replace the other's)."""
    given = [str(w) for w in ([workdirs] if isinstance(workdirs, (str, os.PathLike)) else workdirs)]
    seen: dict[str, str] = {}                               # folder name -> the workdir given with it
    for w in given:
        name = w.rstrip("/").rsplit("/", 1)[-1]
        if name in seen:
            same = (os.path.realpath(seen[name]) == os.path.realpath(w)) if "://" not in w else \
                seen[name].rstrip("/") == w.rstrip("/")
            raise UserError(f"--workdir {w} " + ("is given twice" if same else f"has the folder name of {seen[name]}")
                            + ": the analyses name their outputs and rows by it", "--workdir",
                            "give each run once" if same else "analyse runs of one folder name in separate commands")
        seen[name] = w
    return [load_run(w, step, data) for w in given]
