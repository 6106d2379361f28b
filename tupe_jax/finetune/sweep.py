"""`python -m launch glue-sweep`: the paper's protocol, tasks x `sweep.learning_rates` x `sweep.seeds` sub-runs
(finished ones skipped), then sweep.json / sweep.md (median over seeds per lr; best lr; GLUE average).

Layout: <workdir>/<task>/lr=<lr>/seed=<seed>/ is one `finetune` run each.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import ml_collections

from tupe_jax import files
from tupe_jax import workdir as workdir_lib
from tupe_jax.config import lock
from tupe_jax.data.builders import check_glue_task, glue_fingerprint
from tupe_jax.errors import UserError, require
from tupe_jax.finetune import scores
from tupe_jax.finetune.init_from import resolve_init_from
from tupe_jax.finetune.loop import finetune
from tupe_jax.finetune.runner import check_examples, read_diagnostic
from tupe_jax.finetune.validate import paper_epochs, sweep_tasks, validate


def run_dir(workdir: str, task: str, lr: float, seed: int) -> str:
    return os.path.join(workdir, task, f"lr={float(lr):g}", f"seed={int(seed)}")


def sub_config(config: ml_collections.ConfigDict, task: str, lr: float, seed: int) -> ml_collections.ConfigDict:
    """The sweep's config for one (task, lr, seed) run."""
    sub = ml_collections.ConfigDict(config.to_dict())
    sub.task, sub.sweep.tasks = task, task
    sub.train.learning_rate, sub.train.seed = float(lr), int(seed)
    sub.train.epochs = int(config.train.epochs) or paper_epochs(task)
    return lock(sub)


def sweep(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Run every (task, lr, seed) not finished yet, then write sweep.json and sweep.md; returns sweep.json's dict."""
    validate(config, jax.device_count())
    tasks = sweep_tasks(config)
    lrs = [float(x) for x in config.sweep.learning_rates]
    seeds = [int(s) for s in config.sweep.seeds]
    grid = [(t, lr, s) for t in tasks for lr in lrs for s in seeds]
    for task in tasks:              # every task's files, read through, before the first sub-run trains
        first = sub_config(config, task, lrs[0], seeds[0])
        check_glue_task(first, task, "--config.sweep.tasks")
        check_examples(first, task)
        if task == "mnli" and bool(first.train.predict_test):   # and MNLI's AX set
            read_diagnostic(first)
    init = _init_step(config, [run_dir(workdir, *g) for g in grid])
    config = _pinned(config, init)  # every sub-run of this command reads that step, even while the run trains on
    data_keys: dict[str, str] = {}  # the examples' key per task (the same for each lr and seed), made when needed
    for task, lr, seed in grid:     # sub-runs already there are reused only if this sweep would make them the same
        check_existing(sub_config(config, task, lr, seed), run_dir(workdir, task, lr, seed), init, data_keys)
    for i, (task, lr, seed) in enumerate(grid, 1):
        path = run_dir(workdir, task, lr, seed)
        if files.isfile(files.join(path, "results.json")):
            print(f"[{i}/{len(grid)}] {task} lr={lr:g} seed={seed}: done, skipping", flush=True)
            continue
        print(f"[{i}/{len(grid)}] {task} lr={lr:g} seed={seed} -> {path}", flush=True)
        out = finetune(sub_config(config, task, lr, seed), path)   # claims (checks, locks, writes) its folder
        if out.get("preempted"):
            print("sweep stopped by preemption; rerun the same command to continue", flush=True)
            return {"preempted": True}
    summary = scores.summarize_sweep(workdir, tasks, lrs, seeds, run_dir)
    summary["init"] = {"workdir": init[0], "step": init[1]} if init else None
    if jax.process_index() == 0:
        files.write_json(files.join(workdir, "sweep.json"), summary)
        files.write_text(files.join(workdir, "sweep.md"), scores.sweep_markdown(summary))
        print(scores.sweep_markdown(summary), flush=True)
    return summary


def _init_step(config: ml_collections.ConfigDict, paths: list[str]) -> tuple[str, int] | None:
    """(pretraining run, step) the sweep's sub-runs start from (init_step -1: its newest checkpoint now). When
    init_from is gone (moved, deleted) but every sub-run in `paths` has started, none needs it: the step they
    recorded, which a pinned init_step must name (`check_existing` then holds each sub-run to it)."""
    if not str(config.init_from):
        return None
    try:
        source, step = resolve_init_from(str(config.init_from), int(config.init_step))
    except UserError as err:
        made = [_recorded(p) for p in paths]
        if files.exists(files.absolute(os.path.expanduser(str(config.init_from)))) or any(m is None for m in made) \
                or not made[0][2]:
            raise                  # there but not a pretraining run, or a sub-run would need it
        init = made[0][2]
        pinned = int(config.init_step)
        require(pinned < 0 or pinned == int(init["step"]), f"the sub-runs started from {init['workdir']} step "
                f"{init['step']}, this sweep asks for step {pinned} ({err.what})", "--config.init_step",
                f"give --config.init_step={init['step']} (the step its sub-runs read), or sweep into a fresh workdir")
        print(f"note: {err.what}; every sub-run has started, so the sweep goes on without it, from "
              f"{init['workdir']} step {init['step']} as they recorded", flush=True)
        return init["workdir"], int(init["step"])
    steps = workdir_lib.checkpoint_steps(source)
    require(step is not None or bool(steps), f"init_from {source} has no checkpoint", "--config.init_from",
            "point it at a pretraining run with a checkpoint")
    return source, int(step if step is not None else steps[-1])


def _pinned(config: ml_collections.ConfigDict, init: tuple[str, int] | None) -> ml_collections.ConfigDict:
    """`config` with init_step set to the step resolved once (a pretraining run still training would give the
    sub-runs of one command different steps)."""
    if init is None:
        return config
    out = ml_collections.ConfigDict(config.to_dict())
    out.init_step = init[1]
    return lock(out)


def check_existing(sub: ml_collections.ConfigDict, path: str, init: tuple[str, int] | None,
                   data_keys: dict[str, str]) -> None:
    """A sub-run already in `path` (finished: results.json; started: a checkpoint) must be what `sub` would make
    now: the keys a resume may not change, the pretraining checkpoint it started from and the task's examples (the
    sweep ranks them side by side; a rerun with other settings ranked old and new runs together). `data_keys`:
    the examples' keys found so far, by task."""
    found = _recorded(path)
    if found is None:
        return                     # nothing trained there yet: the sub-run's own gate checks it when it starts
    what, made, source = found
    try:
        workdir_lib.check_config(path, sub)
    except UserError as err:
        raise UserError(f"the {what} sub-run {path} was made otherwise: {err.what}", err.where,
                        f"sweep with the settings of its {what} sub-runs, or into a fresh workdir") from None
    had = (source["workdir"], int(source["step"])) if source else ("", None)
    now = init or ("", None)
    require(had == now, f"the {what} sub-run {path} started from {had[0] or 'scratch'} step {had[1]}, this "
            f"sweep's new ones from {now[0] or 'scratch'} step {now[1]}", "--config.init_step",
            (f"give --config.init_step={had[1]} (the step its sub-runs read), or " if had[1] is not None else "")
            + "sweep into a fresh workdir")
    saved = (source or {}).get("checkpoint")         # '' or absent: recorded before the field, not checked
    now_saved = workdir_lib.checkpoint_identity(*init) if saved and init else ""
    require(not now_saved or now_saved == saved, f"the {what} sub-run {path} started from {had[0]} step {had[1]} as "
            "saved then, and that checkpoint is another one now (the run was trained again)", "--config.init_from",
            "sweep into a fresh workdir to fine-tune the run as it is now, or restore the run it started from")
    task = str(sub.task)
    if "data" in made:             # results.json of earlier versions lack it
        if task not in data_keys:
            data_keys[task] = glue_fingerprint(sub, task)
        require(made["data"] == data_keys[task], f"the {task} examples differ from those "
                f"the {what} sub-run {path} was scored on (its GLUE files or tfds dataset changed since)",
                "--config.data.glue_dir", "restore the examples it was made with, or sweep into a fresh workdir")


def _recorded(path: str) -> tuple[str, dict, dict | None] | None:
    """(what, made, init) of a sub-run in `path`: "finished" and its results.json, or "started" and its last
    checkpoint's progress; init = the pretraining {"workdir", "step"} it started from. None: nothing trained there."""
    done = files.join(path, "results.json")
    if files.isfile(done):
        made = files.read_json(done)
        return "finished", made, ({"workdir": made.get("init_from"), "step": made.get("init_step"),
                                   "checkpoint": made.get("init_checkpoint", "")} if made.get("init_from") else None)
    steps = workdir_lib.checkpoint_steps(path)
    if not steps:
        return None
    made = workdir_lib.read_meta(path, steps[-1], "--workdir", item="data")   # its progress
    return "started", made, made.get("init")
