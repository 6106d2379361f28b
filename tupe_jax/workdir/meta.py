"""The checkpoint's `meta` item: what a later fine-tune, resume or evaluation needs to refuse a mismatch."""
from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Mapping, Optional, TypeVar

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from tupe_jax import checkpoint as ckpt_lib
from tupe_jax import config as config_lib
from tupe_jax import files
from tupe_jax import sharding
from tupe_jax.errors import UserError

T = TypeVar("T")
# How often `read_kept_step` lists a live run's checkpoints again after the one it read was deleted meanwhile.
READ_ATTEMPTS = 5

# Sections that define "the same model and data": the meta's config hash covers these.
RUN_IDENTITY_SECTIONS = ("model", "data")
# Keys that may change when a run continues. Entries ending in "." cover a whole section. Everything else —
# model, data, optimizer, batch, seed, task, init_from — is what the run IS and is never changed in place.
RESUMABLE = (
    "train.steps", "train.epochs",                                      # train longer
    "train.log_every", "train.eval_every", "train.eval_steps", "train.eval_batch_size", "train.predict_test",
    "train.profile_steps",
    "checkpoint.", "metrics.", "mesh.",                                 # how it is saved, measured, laid out
    "model.attention_backend",                                          # same maths, another kernel
    "model.last_layer_rows",                                            # same maths, fewer rows computed
    "data.cache_dir", "data.tfds_data_dir", "data.prefetch", "data.num_threads",   # where/how data is read
    "data.path", "data.glue_dir",   # where the text is: a copy elsewhere resumes, other text is refused by its key
    "sweep.", "schemes", "seeds", "glue.", "eval.", "probe.",           # a sweep's or suite's grid and analyses
    "init_step",          # read once, when a fine-tune starts (results.json names the step; a sweep checks it)
)
# Keys added after runs were already made, with the value that reproduces those runs: a stored config.json without
# the key is read as having that value (so old runs resume, are reused and keep their identity hash).
ADDED_DEFAULTS: dict[str, Any] = {
    "model.sinusoidal_style": "scaled",
    "model.dropout_bits": 32,
    "model.type_vocab_size": 0,
    "model.last_layer_rows": "all",
    "init_from": "", "init_step": -1,     # a pretraining config's (a fine-tune's always had them)
    "eval.stride": 0,     # a compare suite's (unset: nonoverlapping windows, as the suites before it scored)
}


def with_added_defaults(flat: Mapping[str, Any]) -> dict[str, Any]:
    """A flattened stored config with the ADDED_DEFAULTS it lacks (only in sections it has; a top-level key is
    added to every config: both sides of a comparison get it)."""
    sections = {k.split(".")[0] for k in flat}
    return {**{k: v for k, v in ADDED_DEFAULTS.items() if "." not in k or k.split(".")[0] in sections}, **flat}


def resumable(key: str) -> bool:
    return any(key == r or (r.endswith(".") and key.startswith(r)) for r in RESUMABLE)


# Keys made resumable in session 41: the checkpoints made before hashed them (`same_identity` reads those hashes).
HASHED_RESUMABLE = ("data.path", "data.glue_dir")
# ADDED_DEFAULTS keys that one earlier version hashed even at their default (runs made between the key's addition
# and the rule above carry that hash); keys added later never were.
HASHED_AT_DEFAULT = ("model.sinusoidal_style",)


def identity_hash(config: ml_collections.ConfigDict | dict, *, keep_added: tuple[str, ...] = (),
                  hashed: Mapping[str, Any] | None = None) -> str:
    """A hash of the model/data keys that define the run (the resumable ones left out; an ADDED_DEFAULTS key at its
    default value too, unless named in `keep_added`: so runs from before the key existed keep their hash).
    `hashed`: resumable keys hashed with these values (as a version before they were resumable hashed them)."""
    as_dict = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else dict(config)
    flat = config_lib.flatten({s: as_dict.get(s, {}) for s in RUN_IDENTITY_SECTIONS})
    kept = {k: v for k, v in flat.items() if not resumable(k)
            and (k in keep_added or not (k in ADDED_DEFAULTS and v == ADDED_DEFAULTS[k]))}
    kept.update({k: v for k, v in (hashed or {}).items() if k in flat})
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def same_identity(stored: str, config: ml_collections.ConfigDict | dict,
                  then: Optional[list[Mapping[str, Any]]] = None) -> bool:
    """Whether a checkpoint's stored identity is `config`'s, as hashed now, or as hashed by the version that kept
    HASHED_AT_DEFAULT keys at their default, or by the versions that hashed HASHED_RESUMABLE keys: with any of the
    values in `then` (those the run had: `gate.paths_then`), or `config`'s own without them."""
    flat = config_lib.flatten(config.to_dict() if isinstance(config, ml_collections.ConfigDict) else dict(config))
    olds = then if then is not None else [{k: flat[k] for k in HASHED_RESUMABLE if k in flat}]
    return stored in {identity_hash(config, keep_added=keep, hashed=h)
                      for keep in ((), HASHED_AT_DEFAULT) for h in (None, *olds)}


def make_meta(config: Any, params: Any, tokenizer_fingerprint: str = "") -> dict[str, Any]:
    """The meta item of a checkpoint of `config` with `params`."""
    return {"config_hash": config_lib.config_hash(config, RUN_IDENTITY_SECTIONS), "pe": str(config.model.pe),
            "objective": str(config.model.objective), "param_shapes": ckpt_lib.param_shapes(params),
            "tokenizer": tokenizer_fingerprint, "identity": identity_hash(config)}


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


def checkpoint_identity(workdir: str, step: int) -> str:
    """When Orbax began and committed `workdir`'s checkpoint `step`: '<init ns>-<commit ns>' from the step's
    _CHECKPOINT_METADATA, '' where that does not read. A copy of the folder keeps it; a run trained again into the
    folder gets another. A fine-tune records its source's (results.json `init_checkpoint`), and a suite reuses a
    fine-tune only while its pretraining run's step still has it."""
    try:
        record = json.loads(files.read_text(files.join(workdir, "checkpoints", str(int(step)), "_CHECKPOINT_METADATA")))
        return f"{int(record['init_timestamp_nsecs'])}-{int(record['commit_timestamp_nsecs'])}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ""


def checkpoint_steps(workdir: str) -> list[int]:
    """Committed checkpoint steps of `workdir` ([] when it has none)."""
    if not files.isdir(files.join(workdir, "checkpoints")):
        return []
    with ckpt_lib.Checkpointer(workdir, read_only=True, async_=False) as checkpointer:
        return checkpointer.all_steps()


def read_meta(workdir: str, step: int, where: str = "--step", item: str = "meta") -> dict[str, Any]:
    """The meta item of `workdir`'s checkpoint `step` (`item='data'`: its data item, e.g. a fine-tune's progress);
    a UserError naming `where` if it does not read."""
    with ckpt_lib.Checkpointer(workdir, read_only=True, async_=False) as checkpointer:
        return checkpointer.restore_meta(step, where, item)


def latest_meta(workdir: str) -> tuple[int | None, dict[str, Any]]:
    """(newest committed step whose meta reads, its meta) — (None, {}) without checkpoints; a newer step whose meta
    does not read is named in a warning, as a resume falls back past it (`Checkpointer.newest_meta`). Read by the
    gate only after `lock.refuse_if_held`: a live run could prune the step between the listing and the read."""
    if not files.isdir(files.join(workdir, "checkpoints")):
        return None, {}
    with ckpt_lib.Checkpointer(workdir, read_only=True, async_=False) as checkpointer:
        return checkpointer.newest_meta()


def _agreed(value: int) -> int:
    """Process 0's `value` on every process (the value itself in a single process)."""
    if jax.process_count() == 1:
        return value
    return int(multihost_utils.broadcast_one_to_all(np.asarray(value, np.int32)))


READ, DELETED, FAILED = 0, 1, 2   # how a process's read of the agreed step went


def _step_folder(workdir: str, step: int) -> bool:
    """Whether checkpoint `step`'s folder is there: a plain listing. An Orbax one (`checkpoint_steps`) is a
    collective call on several processes, so only every process together may make it, never one alone."""
    return files.isdir(files.join(workdir, "checkpoints", str(step)))


def read_kept_step(workdir: str, step: Optional[int], read: Callable[[int], T], where: str = "--step",
                   follow: bool = True, where_run: str = "--workdir") -> tuple[int, T]:
    """(step, read(step)) for checkpoint `step` of `workdir` (None: its newest), safe beside a run still training
    there: that run's retention (checkpoint.keep) may delete the step between the listing and the end of the read
    (`read` may read several items of it).
    A read that fails for a step no longer listed is retried on the newest step when `follow` (the caller asked
    for the newest: `step` is then the newest it saw earlier, which may be gone before this listing), and is
    otherwise a UserError naming the steps kept now; any other failure is raised as is.
    Several processes read the step process 0 chose and end alike: each attempt makes the same collective calls
    on every process (the listing, the agreement, the gathered outcome; what only some processes ask is read from
    the folder), all return together, or all stop (the failing process with its own error)."""
    for _ in range(READ_ATTEMPTS):
        steps = checkpoint_steps(workdir)
        chosen = _agreed(steps[-1] if step is None and steps else -1 if step is None else step)
        if chosen >= 0 and chosen not in steps and _step_folder(workdir, chosen):
            steps = sorted(steps + [chosen])   # a save process 0 listed and this process's listing missed
        failure: Optional[BaseException] = None
        value = None
        if chosen < 0 or not steps:
            failure = UserError(f"no checkpoint in {workdir}/checkpoints", where_run, "pretrain this workdir first")
        elif chosen not in steps:
            failure = UserError(f"no checkpoint at step {chosen} in {workdir}/checkpoints", where,
                                f"use one of {steps}")
        else:
            try:
                value = read(chosen)
            except Exception as err:  # pylint: disable=broad-except
                failure = err
        gone = chosen in steps and not _step_folder(workdir, chosen)   # deleted during the read
        gone = gone or (follow and step is not None and chosen >= 0 and chosen not in steps)   # before the listing
        status = READ if failure is None else DELETED if gone else FAILED
        statuses = sharding.gathered(status)
        if all(s == READ for s in statuses):
            return chosen, value
        if status == FAILED:
            raise failure
        if FAILED in statuses:
            raise UserError(f"process {statuses.index(FAILED)} could not read checkpoint step {chosen} of {workdir}",
                            where, "see that process's error")
        if not follow:
            raise UserError(f"checkpoint step {chosen} of {workdir} was deleted while it was being read (a run "
                            f"training there keeps only its newest checkpoint.keep steps)", where,
                            f"use one of the steps kept now, {checkpoint_steps(workdir)}, or leave the step out for "
                            "the newest") from None
        step = None
    raise UserError(f"the newest checkpoint of {workdir} was deleted while it was being read, {READ_ATTEMPTS} times "
                    "in a row (a run training there saves faster than the read)", where,
                    "read it once that run has finished, or give it a larger checkpoint.keep")
