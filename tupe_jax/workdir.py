"""Everything about a run's folder: its `config.json` and the "same run" check, the checkpoint meta and the
tokenizer check, loading a finished run (`LoadedRun`, used by evaluate, fine-tuning and every analysis), and
claiming a folder for a command (cleaning up what a failed command created in it).

A run folder (`--workdir`) holds:
    config.json          the resolved config (written by `claim`; `read_config` reads it back)
    tokenizer/vocab.txt  the run's WordPiece vocabulary (data.tokenizer)
    checkpoints/<step>/  Orbax items state / data / meta (checkpoint.py; meta from `make_meta`)
    metrics.jsonl, tensorboard/   (metrics.py)
    results.json, predictions/    fine-tuning runs (finetune/)
    analysis/            outputs of the analysis commands (default `--out`)
Whole-file writes go through `files.write_json` / `files.write_text` (atomic).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from typing import Any, Iterator, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from tupe_jax import checkpoint as ckpt_lib
from tupe_jax import config as config_lib
from tupe_jax import files
from tupe_jax.data.tokenizer import get_tokenizer
from tupe_jax.errors import UserError, require
from tupe_jax.model import ModelConfig, TransformerLM
from tupe_jax.positional import TABLE_SCHEMES, canonical_name

# Sections that define "the same run": a folder refuses a config that differs in these.
RUN_IDENTITY_SECTIONS = ("model", "data")


def config_path(workdir: str) -> str:
    return os.path.join(workdir, "config.json")


def tokenizer_path(workdir: str) -> str:
    return os.path.join(workdir, "tokenizer", "vocab.txt")


# ================================================================================================ config.json
def read_config(workdir: str) -> ml_collections.ConfigDict:
    """`workdir/config.json` as a locked ConfigDict (UserError if missing or not JSON)."""
    path = config_path(workdir)
    require(os.path.isfile(path), f"{path} does not exist", "--workdir", "point it at a run made by `launch pretrain`")
    try:
        data = files.read_json(path)
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON ({err.msg}, line {err.lineno})", "--workdir",
                        "restore it or start a fresh workdir") from None
    return config_lib.lock(ml_collections.ConfigDict(data))


def write_config(workdir: str, config: ml_collections.ConfigDict, overwrite: bool = False,
                 write: bool = True) -> None:
    """Write `workdir/config.json`, refusing one that holds another run's model/data config unless `overwrite`.

    With `write=False` (processes other than 0) only the check runs.
    """
    path = config_path(workdir)
    if os.path.isfile(path) and not overwrite:
        try:
            old = files.read_json(path)
        except json.JSONDecodeError:
            old = {}
        diffs = config_lib.config_differences(old, config.to_dict(), RUN_IDENTITY_SECTIONS)
        if diffs:
            shown = "; ".join(diffs[:3]) + (f"; and {len(diffs) - 3} more" if len(diffs) > 3 else "")
            raise UserError(f"{path} holds another run's config ({shown})", "--workdir",
                            "use a fresh workdir, or pass --overwrite_config to replace it")
    if write:
        files.write_text(path, config_lib.to_json(config) + "\n")


def differing_keys(workdir: str, config: ml_collections.ConfigDict, sections: tuple[str, ...],
                   ignore: tuple[str, ...] = ()) -> list[str]:
    """"key: old -> new" for keys of `sections` where `workdir/config.json` differs from `config` (bar `ignore`
    prefixes); [] when the folder has no config.json."""
    path = config_path(workdir)
    if not os.path.isfile(path):
        return []
    old = files.read_json(path)
    return [d for d in config_lib.config_differences(old, config.to_dict(), sections) if not d.startswith(ignore)]


# ================================================================================================ claiming a folder
def _holds_results(path: str) -> bool:
    """True if `path` holds a committed checkpoint step or a results file (worth keeping after an error)."""
    if os.path.isfile(path):
        return False
    for root, dirs, names in os.walk(path):
        if os.path.basename(root) == "checkpoints" and any(d.isdigit() for d in dirs):
            return True
        if {"results.json", "sweep.json"} & set(names):
            return True
    return False


def remove_partial_outputs(workdir: str, before: Optional[set[str]]) -> None:
    """Remove what a failed command created in `workdir` (config.json, tokenizer/, metrics, ...) unless it produced
    checkpoints or results. Entries that existed before (`before`, None = the folder did not exist) stay."""
    if not os.path.isdir(workdir):
        return
    new = sorted(set(os.listdir(workdir)) - (before or set()))
    if any(_holds_results(os.path.join(workdir, name)) for name in new):
        return
    for name in new:
        path = os.path.join(workdir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)
    if before is None and not os.listdir(workdir):
        os.rmdir(workdir)


@contextlib.contextmanager
def claim(workdir: str, config: ml_collections.ConfigDict, overwrite: bool = False) -> Iterator[None]:
    """Write (process 0) or check `workdir/config.json` for a command that runs `config` there; if the command
    raises UserError, remove what it created in the folder (see `remove_partial_outputs`) and re-raise."""
    lead = jax.process_index() == 0
    before = set(os.listdir(workdir)) if os.path.isdir(workdir) else None
    try:
        write_config(workdir, config, overwrite=overwrite, write=lead)
        yield
    except UserError:
        if lead:
            remove_partial_outputs(workdir, before)
        raise


# ================================================================================================ checkpoint meta
def make_meta(config: Any, params: Any, tokenizer_fingerprint: str = "") -> dict[str, Any]:
    """The checkpoint's `meta` item: what a later fine-tune, resume or evaluation needs to refuse a mismatch."""
    return {"config_hash": config_lib.config_hash(config, RUN_IDENTITY_SECTIONS), "pe": str(config.model.pe),
            "objective": str(config.model.objective), "param_shapes": ckpt_lib.param_shapes(params),
            "tokenizer": tokenizer_fingerprint}


def check_tokenizer(meta: Mapping[str, Any], fingerprint: str, vocab_path: str) -> None:
    """Raise UserError if the checkpoint was trained with another vocabulary than the one at `vocab_path`."""
    saved = meta.get("tokenizer") or ""
    if saved and fingerprint and saved != fingerprint:
        raise UserError(f"the tokenizer at {vocab_path} (fingerprint {fingerprint}) is not the one the checkpoint "
                        f"was trained with (fingerprint {saved})", vocab_path,
                        "restore the run's original vocab.txt or start a fresh workdir")


def check_compatible(meta: Mapping[str, Any], pe: str, shapes: Mapping[str, list[int]] | None = None,
                     where: str = "--config.init_from") -> None:
    """Raise UserError if checkpoint `meta` has another positional scheme or other param shapes."""
    if meta.get("pe") != pe:
        raise UserError(f"the checkpoint was trained with pe={meta.get('pe')!r}, not pe={pe!r}", where,
                        f"fine-tune with pe={meta.get('pe')} or pick a checkpoint of {pe}")
    saved = meta.get("param_shapes", {})
    for key, shape in (shapes or {}).items():
        if key in saved and list(saved[key]) != list(shape):
            raise UserError(f"param {key} has shape {saved[key]} in the checkpoint but {list(shape)} here", where,
                            "use the same model size (model.* keys) as the pretraining run")


def checkpoint_steps(workdir: str) -> list[int]:
    """Committed checkpoint steps of `workdir` ([] when it has none)."""
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        return []
    with ckpt_lib.Checkpointer(workdir, read_only=True, async_=False) as checkpointer:
        return checkpointer.all_steps()


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

    @property
    def name(self) -> str:
        base = os.path.basename(os.path.normpath(self.workdir)) if self.workdir else ""
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
                "hidden_size": c.hidden_size, "num_heads": c.num_heads}


def load_run(workdir: str, step: Optional[int] = None) -> LoadedRun:
    """A finished (or running) pretraining run's config, params (default device), tokenizer and step."""
    config = read_config(workdir)
    cfg = ModelConfig.from_config(config.model)
    steps = checkpoint_steps(workdir)
    require(bool(steps), f"no checkpoint in {workdir}/checkpoints", "--workdir", "pretrain this workdir first")
    require(step is None or step in steps, f"no checkpoint at step {step} in {workdir}/checkpoints", "--step",
            f"use one of {steps}")
    step = steps[-1] if step is None else step
    with ckpt_lib.Checkpointer(workdir, read_only=True, async_=False) as checkpointer:
        meta = checkpointer.restore_meta(step)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.eval_shape(lambda: TransformerLM(cfg).init({"params": jax.random.PRNGKey(0)},
                                                              jnp.zeros((1, 8), jnp.int32))["params"])
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                                      nn.meta.unbox(abstract))
    params = ckpt_lib.restore_params(workdir, step, abstract)
    tokenizer = get_tokenizer(config, workdir)
    check_tokenizer(meta, tokenizer.fingerprint, tokenizer_path(workdir))
    return LoadedRun(config, cfg, params, tokenizer, step, str(workdir))


def load_runs(workdirs: str | list[str], step: Optional[int] = None) -> list[LoadedRun]:
    """`load_run` for each workdir."""
    return [load_run(str(w), step) for w in ([workdirs] if isinstance(workdirs, (str, os.PathLike)) else workdirs)]
