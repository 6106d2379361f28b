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
from tupe_jax.config import lock
from tupe_jax.finetune import scores
from tupe_jax.finetune.loop import finetune
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
    for i, (task, lr, seed) in enumerate(grid, 1):
        path = run_dir(workdir, task, lr, seed)
        if os.path.isfile(os.path.join(path, "results.json")):
            print(f"[{i}/{len(grid)}] {task} lr={lr:g} seed={seed}: done, skipping", flush=True)
            continue
        print(f"[{i}/{len(grid)}] {task} lr={lr:g} seed={seed} -> {path}", flush=True)
        out = finetune(sub_config(config, task, lr, seed), path)   # claims (checks, locks, writes) its folder
        if out.get("preempted"):
            print("sweep stopped by preemption; rerun the same command to continue", flush=True)
            return {"preempted": True}
    summary = scores.summarize_sweep(workdir, tasks, lrs, seeds, run_dir)
    if jax.process_index() == 0:
        files.write_json(os.path.join(workdir, "sweep.json"), summary)
        files.write_text(os.path.join(workdir, "sweep.md"), scores.sweep_markdown(summary))
        print(scores.sweep_markdown(summary), flush=True)
    return summary
