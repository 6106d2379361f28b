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
from tupe_jax import files
from tupe_jax.config import apply_overrides
from tupe_jax.data import check_data_keys, corpus_keys
from tupe_jax.data.prepared import check_settings, prepared_tokenizer
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
    fresh_mlm_head: bool = False    # its MLM head was initialised at import (meta `fresh_mlm_head`), never trained

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
    (`{"data.path": ..., ...}`), its config names that corpus instead of its own (`corpus_config`)."""
    config = read_config(workdir)
    if "task" in config:
        raise UserError(f"{workdir} is {finetune_kind(workdir, config)}; this command reads a pretraining run",
                        "--workdir", "point it at the run given as init_from, or at a `launch pretrain` workdir")
    if folder_kind(config) != "a pretraining run":
        raise UserError(f"{workdir} holds {folder_kind(config)}; this command reads a pretraining run", "--workdir",
                        "point it at one of the suite's runs (<runs_dir>/<scheme>-s<seed>/)" if "suite" in config
                        else "point it at a `launch pretrain` workdir")
    scored, data = corpus_config(config, data, workdir) if data else (config, {})   # checked before the restore
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
    return LoadedRun(scored, cfg, params, tokenizer, step, str(workdir), data, bool(meta.get("fresh_mlm_head")))


def corpus_config(config: Any, data: Mapping[str, str], workdir: str) -> tuple[Any, dict[str, str]]:
    """(a copy of the run's `config` whose `data` section names another corpus, the overrides as applied): `data`
    holds `--config.data.*` overrides, checked against the section's keys, types and values; a key the corpus or
    the run's objective does not read is refused, local paths are made absolute and must exist, and a prepared
    directory must have been made for this run (its tokenizer, objective, max_len). Nothing heavy is read."""
    given = {k: _absolute(k, str(v)) for k, v in data.items()}
    scored = copy.deepcopy(config)
    apply_overrides(scored, given)
    check_data_keys(scored)
    name, objective = str(scored.data.get("name", "")), str(scored.model.get("objective", "mlm"))
    reads = corpus_keys(name, objective)
    for key in given:
        require(key.split(".", 1)[1] in reads, f"{key} does nothing for data.name={name!r}" +
                (" in a causal LM" if objective != "mlm" else ""), f"--config.{key}",
                "drop it (that corpus reads --config.data." + ", ".join(reads) + ")")
    for key in ("data.path", "data.cache_dir"):
        value = str(scored.data.get(key.split(".")[1], "") or "")
        if key in given and value and not files.is_remote(value) and not any(c in value for c in "*?["):
            require(key != "data.path" or os.path.exists(value), f"{value} does not exist", f"--config.{key}",
                    "give an existing folder or file")
            require(not (os.path.realpath(value) + os.sep).startswith(os.path.realpath(workdir) + os.sep),
                    f"{value} is inside the run {workdir}", f"--config.{key}",
                    "give a folder outside the run: scoring another corpus writes nothing there")
    if name == "prepared":
        try:
            check_settings(scored)
        except UserError as err:   # the model keys are the run's: it is the directory that must change
            if not err.where.startswith("--config.model."):
                raise
            raise UserError(err.what, "--config.data.path", "prepare the corpus for this run (its objective, "
                            "max_len and tokenizer/vocab.txt) into another directory") from None
        require(prepared_tokenizer(scored, None).fingerprint == get_tokenizer(config, workdir).fingerprint,
                f"{scored.data.path} was prepared with another tokenizer than the run's ({workdir})",
                "--config.data.path", f"prepare the corpus with --config.data.vocab_file={tokenizer_path(workdir)} "
                "into a fresh directory")
    return scored, given


def _absolute(key: str, value: str) -> str:
    """A local path override as an absolute path (`~` expanded): what the outputs record means the same anywhere."""
    if key not in ("data.path", "data.cache_dir", "data.tfds_data_dir") or not value or files.is_remote(value):
        return value
    return os.path.abspath(os.path.expanduser(value))


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
