"""Checkpoints at `workdir/checkpoints/<step>/`: a small wrapper over Orbax's v0 `CheckpointManager`.

Each step holds three items:
- `state`: the train-state pytree (params, opt_state, step, rng), `StandardSave`/`StandardRestore`. Restores go
  against an abstract tree carrying target shardings, so a checkpoint loads onto a different mesh shape.
- `data`: the data-iterator state (a JSON-able dict, e.g. grain's `get_state()`), `JsonSave`.
- `meta`: JSON with the config hash, scheme, objective, param shapes and tokenizer fingerprint, written and
  checked by `workdir/meta.py` (`make_meta`, `check_compatible`, `check_tokenizer`), so a fine-tune or a resume
  refuses a checkpoint of another scheme, shape or vocabulary. This module only stores it. Paths may be local or
  in a bucket (`gs://`: Orbax + tensorstore write there directly).

Locally Orbax writes each step into a temporary folder and renames it when complete; in a bucket it writes straight
into `<step>/` and adds `commit_success.txt` last. Either way an unfinished save is not a step (`committed`), and a
writer removes those a stopped run left (`Checkpointer._remove_unfinished`). If the newest step fails to restore
(corrupt files), `restore` warns naming it and falls back to the previous step; nothing is deleted. The read-only
paths (`restore_params`, `restore_meta`: evaluate, export, the analyses, init_from) never fall back by themselves: a
step that does not read is a one-line error naming the other steps, and what a failed read leaves in flight is kept
off stderr (`failed_reads`). Preemption: `install_sigterm_handler()` makes SIGTERM set a flag; the loop polls
`Checkpointer.reached_preemption(step)` (that flag, or Orbax/JAX's multi-host preemption sync point), then saves with
`force=True`, calls `wait()` and exits 0.

Several processes (a pod) decide together: SIGTERM is left to JAX's preemption notifier (a notice to any host
reaches every host, and all reach one sync step), and a step that does not restore stops them with a line instead
of a fallback to an earlier step (a bad shard is read only by the hosts that own it: each would fall back alone).
"""
from __future__ import annotations

import logging
import signal
import time
from typing import Any, Mapping

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp

from tupe_jax import failed_writes, files
from tupe_jax.errors import UserError
from tupe_jax.failed_reads import describe, quiet_leftovers

log = logging.getLogger(__name__)
_STOP = {"requested": False}
_STEPS_ASKED = {"count": 0}   # the steps this process has asked JAX's preemption sync about (`reached_preemption`)
_ONE_PROCESS_HANDLER = {"registered": False}


def write_replicas_whole_in_one_process() -> None:
    """In a single-process run, have Orbax write each replicated array whole from one replica.

    Orbax's default (off only on GPU) is replica-parallel saving: each of R replicas of an array writes 1/R of it,
    so the hosts of a pod share the writes. In one process every slice is written by that same process anyway, and
    each slice is an eager `lax.slice`, compiled once per shape and offset: ~500 slices and ~80 compiles, ~3–5 s of
    the first save of a tiny run on 8 CPU devices, for no gain. With several processes Orbax's default stays. Only the
    write is affected: the values, and a restore of checkpoints written either way, are the same."""
    if jax.process_count() == 1 and not _ONE_PROCESS_HANDLER["registered"]:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
        _ONE_PROCESS_HANDLER["registered"] = True


def install_sigterm_handler() -> None:
    """Make SIGTERM set a flag (see `stop_requested`) instead of killing the process mid-step.

    Not in a `jax.distributed` job: there `jax.distributed.initialize` has installed JAX's preemption notifier,
    which tells every process of a SIGTERM to any one and has them all reach the same sync step
    (`Checkpointer.reached_preemption`). A handler here would replace it: each process would stop at its own step,
    at a save the others do not join (a hang, then a crash, and no checkpoint)."""
    if jax.distributed.is_initialized():
        return

    def handler(signum: int, frame: Any) -> None:  # pylint: disable=unused-argument
        log.warning("SIGTERM received: will save this step (unless it is the process's first) and exit")
        _STOP["requested"] = True
    signal.signal(signal.SIGTERM, handler)


def stop_requested() -> bool:
    """True once SIGTERM arrived (after `install_sigterm_handler`)."""
    return _STOP["requested"]


def checkpoint_dir(path: str) -> str:
    """Absolute `path/checkpoints` if `path` is a workdir, else `path` itself (already a checkpoints directory);
    absolute because Orbax refuses relative checkpoint paths (`--workdir=runs/x` is the common spelling)."""
    sub = files.join(path, "checkpoints")
    return files.absolute(sub if files.isdir(sub) else path)


def committed(step_dir: str) -> bool:
    """Whether the folder `step_dir` (`checkpoints/<step>`) is a finished save, as Orbax decides (module doc)."""
    return bool(ocp.step.is_path_finalized(step_dir))


def param_shapes(params: Any) -> dict[str, list[int]]:
    """{"['a']['b']": shape} for every leaf of `params` (boxed or not)."""
    leaves = jax.tree_util.tree_leaves_with_path(nn.meta.unbox(params))
    return {jax.tree_util.keystr(p): [int(d) for d in np.shape(x)] for p, x in leaves}


class Checkpointer:
    """Save / restore train state + data-iterator state + meta under `workdir/checkpoints/`."""

    def __init__(self, workdir: str, every: int = 1000, keep: int = 3, async_: bool = True, read_only: bool = False):
        self.workdir = files.absolute(workdir)
        self.directory = files.absolute(files.join(workdir, "checkpoints"))
        self.every = max(int(every), 1)
        write_replicas_whole_in_one_process()
        quiet_leftovers()   # before any read: a failed read's leftovers can come (on other threads) before its error
        options = ocp.CheckpointManagerOptions(  # the interval is decided in `save`, not by Orbax
            save_interval_steps=1, max_to_keep=keep, create=not read_only, read_only=read_only,
            enable_async_checkpointing=async_)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data", "meta"))
        if not read_only and jax.process_index() == 0:
            self._remove_unfinished()
        self._async = bool(async_)
        self._pending: int | None = None   # the step of the save in flight (for error messages)
        self._reported_full = False
        self._failed_tmp: str | None = None

    def _remove_unfinished(self) -> None:
        """Orbax's unfinished saves (`<step>.orbax-checkpoint-tmp*`; in a bucket a `<step>/` not `committed`), left
        by a kill during a save, are never read; one at a step saved again is replaced, any other would stay for
        good. A writer holds the run's lock (`workdir.claim`): no other process's save is in flight here."""
        for name in files.listdir(self.directory) if files.isdir(self.directory) else []:
            path = files.join(self.directory, name)
            if ".orbax-checkpoint-tmp" in name or (name.isdigit() and not committed(path)):
                files.rmtree(path)
                print(f"{self.directory}: removed {name}, a save that a stopped run did not finish", flush=True)

    def save(self, step: int, state: Any, data_state: Mapping[str, Any] | None = None,
             meta: Mapping[str, Any] | None = None, force: bool = False) -> bool:
        """Save at `step` if it is due (`step % every == 0`) or `force`; asynchronous when enabled. True if saved."""
        if not force and step % self.every:
            return False
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(dict(data_state or {})),
                                  meta=ocp.args.JsonSave(dict(meta or {})))
        with self._write_errors():   # also surfaces a failure of the previous (asynchronous) save
            self._manager.wait_until_finished()
        if int(step) in self.all_steps():  # a committed step that failed to restore (we resumed before it)
            self._set_aside(int(step))
        self._pending = int(step)
        with self._write_errors():
            saved = bool(self._manager.save(int(step), args=args, force=True))
        if not self._async:
            self._pending = None
        return saved

    def _set_aside(self, step: int) -> None:
        """Rename the unrestorable step dir to `<step>.bad-<time>` (kept for inspection, never deleted). One process
        only: with several, a step that does not restore stops the run (`_no_fallback_on_several_processes`)."""
        src = files.join(self.directory, str(step))
        dst = f"{src}.bad-{time.strftime('%Y%m%d-%H%M%S')}"
        log.warning("checkpoint step %d in %s did not restore; moving it to %s (not deleted) to save step %d again",
                    step, self.directory, dst, step)
        files.rename(src, dst)
        self._manager.reload()

    def _write_errors(self):
        """Context manager: a disk-full failure of the pending save becomes a one-line UserError."""
        checkpointer = self

        class _Guard:
            def __enter__(self):
                return self

            def __exit__(self, kind, err, tb):
                if err is None or isinstance(err, UserError) or not failed_writes.is_disk_full(err):
                    return False
                if checkpointer._reported_full:   # Orbax re-raises a stored failure on every wait: said once
                    return True
                checkpointer._reported_full = True
                step = checkpointer._pending
                checkpointer._pending = None
                try:   # let the other writers of this save finish (they fail too) before cleaning up
                    checkpointer._manager.wait_until_finished()
                except Exception:  # pylint: disable=broad-except
                    pass
                tmp = files.join(checkpointer.directory, f"{step}.orbax-checkpoint-tmp")
                checkpointer._failed_tmp = tmp if step is not None else None
                if step is not None:   # the unfinished write, never a committed step
                    failed_writes.remove_when_quiet(tmp)
                try:
                    checkpointer._manager.reload()
                    kept = checkpointer.all_steps()
                except Exception:  # pylint: disable=broad-except
                    kept = []
                reason = failed_writes.full_reason(err)
                raise UserError(f"disk full: could not write checkpoint step {step} ({reason})",
                                checkpointer.directory, "free space (or raise the quota) and rerun the same command "
                                f"to resume; the committed checkpoints {kept} are intact") from None
        return _Guard()

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """All committed steps, ascending."""
        return sorted(self._manager.all_steps())

    def _restore_one(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
                                  meta=ocp.args.JsonRestore())   # meta too: a fine-tune reads it later
        restored = self._manager.restore(step, args=args)
        return restored["state"], dict(restored["data"] or {})

    def restore(self, step: int | None, abstract_state: Any) -> tuple[Any, dict[str, Any]] | None:
        """Restore (state, data_state) onto the shardings in `abstract_state` (ShapeDtypeStructs).

        `step=None`: the newest step that restores cleanly (warning about each bad one, deleting nothing); None if
        there is no checkpoint. An explicit `step` that is missing or fails raises UserError."""
        if step is not None:
            if step not in self.all_steps():
                raise UserError(f"no checkpoint at step {step} in {self.directory}", "--step",
                                f"use one of {self.all_steps()}" if self.all_steps() else "train first")
            steps = self.all_steps()
            try:
                return self._restore_one(step, abstract_state)
            except Exception as err:  # pylint: disable=broad-except
                raise unreadable(self.directory, step, steps, err, "--step") from None
        for candidate in reversed(self.all_steps()):
            try:
                return self._restore_one(candidate, abstract_state)
            except Exception as err:  # pylint: disable=broad-except
                self._no_fallback_on_several_processes(candidate, err)
                log.warning("checkpoint step %d in %s failed to restore (%s); trying the previous one, "
                            "deleting nothing", candidate, self.directory, describe(err))
        if self.all_steps():
            raise UserError(f"no checkpoint in {self.directory} restores (steps {self.all_steps()})", "--workdir",
                            "check the files, or start a fresh workdir")
        return None

    def _no_fallback_on_several_processes(self, step: int, err: BaseException) -> None:
        """With several processes a step that fails to read is an error, not a fallback: a bad shard is read only
        by the processes that hold it, so each would fall back alone (to different steps), and Orbax's restore ends
        at a barrier the failed process never reached. This process stops with the line; the others stop when JAX's
        coordination service finds it gone."""
        if jax.process_count() > 1:
            raise UserError(f"checkpoint step {step} in {self.directory} failed to restore on process "
                            f"{jax.process_index()} ({describe(err)})", "--workdir",
                            f"move {files.join(self.directory, str(step))} aside (e.g. to {step}.bad) and rerun: "
                            "several processes do not fall back to an earlier step by themselves") from None

    def restore_meta(self, step: int | None = None, where: str = "--step", item: str = "meta") -> dict[str, Any]:
        """The `meta` JSON of `step` (default: latest; `item='data'`: the data item); an item that does not read is
        a UserError naming the step (`unreadable`)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise UserError(f"no checkpoint in {self.directory}", "--workdir", "pretrain first")
        steps = self.all_steps()   # listed before the read: a transport failure there must not raise again below
        try:
            return self._meta(step, item)
        except Exception as err:  # pylint: disable=broad-except
            raise unreadable(self.directory, step, steps, err, where) from None

    def newest_meta(self) -> tuple[int | None, dict[str, Any]]:
        """(newest step whose meta reads, its meta), warning about each newer step, as `restore` falls back; (newest
        step, {}) if none reads; (None, {}) without checkpoints."""
        steps = self.all_steps()
        for step in reversed(steps):
            try:
                return step, self._meta(step)
            except Exception as err:  # pylint: disable=broad-except
                self._no_fallback_on_several_processes(step, err)
                log.warning("checkpoint step %d in %s: its meta failed to restore (%s); reading the previous one, "
                            "deleting nothing", step, self.directory, describe(err))
        return (steps[-1], {}) if steps else (None, {})

    def _meta(self, step: int, item: str = "meta") -> dict[str, Any]:
        return dict(self._manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))[item] or {})

    def reached_preemption(self, step: int) -> bool:  # pylint: disable=unused-argument
        """True when the loop should save now and exit: SIGTERM arrived, or JAX's preemption sync point. That point is
        one past the largest step any process reported (1 for a notice during a resume's restore or compile), so
        the report is this process's count of steps, alike on every process, not the run's step (a run resumed at
        S asked about S+1, S+2, ... and never met 1: it trained on until the preemption killed it)."""
        if stop_requested():
            return True
        _STEPS_ASKED["count"] += 1
        return bool(self._manager.reached_preemption(_STEPS_ASKED["count"]))

    def wait(self) -> None:
        """Block until pending asynchronous saves are committed (UserError if the disk filled up)."""
        with self._write_errors():
            self._manager.wait_until_finished()
        self._pending = None

    def close(self) -> None:
        """Wait for pending saves and release the manager."""
        try:
            self.wait()
        finally:
            with self._write_errors():
                self._manager.close()
            if self._failed_tmp:   # written to after the failure was seen
                failed_writes.remove_when_quiet(self._failed_tmp)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def unreadable(directory: str, step: int, steps: list[int], err: BaseException, where: str) -> UserError:
    """The one-line error for checkpoint `step` that a read-only command (evaluate, export, the analyses, a
    fine-tune's init_from) could not read; it names the other steps to ask for instead: such a command reads the
    step it is given, or the newest, and never another one by itself (resuming training does fall back)."""
    others = [s for s in steps if s != step]
    return UserError(f"checkpoint step {step} in {directory} failed to restore ({describe(err)})", where,
                     f"ask for another step ({', '.join(map(str, others))}) or check the files" if others
                     else "check the files, or train again")


def restore_params(path_or_workdir: str, step: int | None = None, abstract_params: Any = None,
                   where: str = "--step", where_run: str = "--workdir") -> Any:
    """Params only, for fine-tuning: from a workdir (or its checkpoints dir) at `step` (default latest).

    With `abstract_params` (ShapeDtypeStructs with shardings) only the params subtree is read, onto those
    shardings; without it the whole state item is read and its params returned. A step that does not read is a
    UserError naming it and `where` (`unreadable`); a missing step names `where` too, with the steps there;
    a folder without checkpoints names `where_run` (the flag that gave the folder)."""
    quiet_leftovers()
    directory = checkpoint_dir(path_or_workdir)
    if not files.isdir(directory):
        raise UserError(f"no checkpoints at {path_or_workdir}", where_run, "point it at a pretraining workdir")
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True, create=False),
                                    item_names=("state", "data", "meta"))
    try:
        step = manager.latest_step() if step is None else step
        steps = sorted(manager.all_steps())
        if step is None:
            raise UserError(f"no checkpoint in {directory}", where_run, "point it at a pretraining workdir with "
                            "checkpoints")
        if step not in steps:
            raise UserError(f"no checkpoint at step {step} in {directory}", where, f"use one of {steps}")
        if abstract_params is None:
            restore = ocp.args.PyTreeRestore()
        else:
            target = {"params": abstract_params}
            restore = ocp.args.PyTreeRestore(item=target, partial_restore=True,
                                             restore_args=ocp.checkpoint_utils.construct_restore_args(target))
        try:
            state = manager.restore(step, args=ocp.args.Composite(state=restore))["state"]
        except Exception as err:  # pylint: disable=broad-except
            raise unreadable(directory, step, steps, err, where) from None
        return state["params"]
    finally:
        manager.close()
