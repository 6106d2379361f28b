"""The GLUE part of a `compare` suite (`suite=tupe`): the tasks (`glue_tasks`), each (scheme, seed, task)
fine-tune's config (`glue_config`: configs/glue.py's sections in `config.finetune`, with the keys the suite sets,
`SET_PER_RUN`), their checks before any pretraining (`validate_finetunes`), and the fine-tunes (`finetune_all`).
"""
from __future__ import annotations

import os
import time

import ml_collections

from tupe_jax import config as config_lib
from tupe_jax import data as data_lib
from tupe_jax import files
from tupe_jax import workdir as workdir_lib
from tupe_jax.analysis.schemes import Scheme, parse_schemes, run_name, run_path, scheme_config
from tupe_jax.data.builders import check_glue_task, local_glue_dir
from tupe_jax.data.glue_tsv import has_train_and_dev
from tupe_jax.errors import UserError, require
from tupe_jax.finetune.loop import finetune
from tupe_jax.finetune.validate import validate as validate_finetune

# 'auto' fine-tunes on every GLUE task with data, bar WNLI (as the TUPE paper) and the built-in word order.
GLUE_CANDIDATES = tuple(t for t in data_lib.GLUE_TASKS if t not in ("wnli", "wordorder"))


class Preempted(Exception):
    """A suite's pretraining or fine-tuning run stopped on preemption (SIGTERM): the suite stops, to resume."""


def refuse_other_config(path: str, new: ml_collections.ConfigDict, sections: tuple[str, ...],
                         ignore: tuple[str, ...], what: str, where: str, fix: str) -> None:
    """Refuse to reuse the run at `path` if its config.json differs from `new` in `sections` (bar `ignore`)."""
    diffs = workdir_lib.differing_keys(path, new, sections, ignore)
    require(not diffs, f"{path} was {what} with other keys ({'; '.join(diffs[:3])})", where, fix)


# The fine-tunes' keys a suite sets itself (`glue_config`) -> what to do instead; an override of one is refused
# (`refuse_set_keys`, the launcher's hook) rather than silently replaced.
SET_PER_RUN = {"finetune.task": "use --config.glue.tasks",
               "finetune.init_from": "drop it: each scheme's own run is fine-tuned",
               "finetune.init_step": "drop it: each scheme's run is fine-tuned from its final step",
               "finetune.train.learning_rate": "use --config.glue.learning_rate",
               "finetune.train.batch_size": "use --config.glue.batch_size",
               "finetune.train.epochs": "use --config.glue.epochs",
               "finetune.train.steps": "use --config.glue.max_steps (a cap on epochs x examples // batch)",
               "finetune.train.seed": "use --config.seeds",
               "finetune.train.predict_test": "drop it: a suite predicts no test split",
               "finetune.train.log_every": "drop it: a suite's fine-tunes log every 50 steps",
               "finetune.checkpoint.every": "drop it: a suite saves each fine-tune's last step",
               "finetune.sweep": "drop it, and run `launch glue-sweep` on a scheme's run for a sweep"}


def refuse_set_keys(config: ml_collections.ConfigDict, arg_keys: frozenset, override_keys: frozenset,
                    workdir: str = "") -> list:
    """Refuse overrides of keys the suite sets per run (`SET_PER_RUN`); nothing is adopted."""
    del config, arg_keys, workdir
    for key in sorted(override_keys):
        hit = next((k for k in SET_PER_RUN if key == k or key.startswith(k + ".")), None)
        require(hit is None, f"{key} is set by the suite for each fine-tune", f"--config.{key}",
                SET_PER_RUN.get(hit or "", ""))
    return []


def validate_finetunes(config: ml_collections.ConfigDict, seed: int, num_devices: int) -> None:
    """The fine-tunes' own checks (e.g. finetune.train.warmup_ratio) on the first one's config, before any
    pretraining; a key of the fine-tune's own sections is named as the suite's (`--config.finetune.train.x`)."""
    tasks = glue_tasks(config)                    # unknown tasks / a missing glue_dir fail before any training
    if not tasks:
        return
    try:
        validate_finetune(_glue_base(config, parse_schemes(config)[0], seed, "", tasks[0]), num_devices)
    except UserError as err:   # model/data/mesh are the suite's own sections; the rest is under `finetune`
        if not err.where.startswith("--config.") or err.where.startswith(("--config.model.", "--config.data.",
                                                                           "--config.mesh.")):
            raise
        raise UserError(f"the fine-tunes' {err.what}", "--config.finetune." + err.where[len("--config."):],
                        err.fix) from None


def glue_tasks(config: ml_collections.ConfigDict) -> list[str]:
    """`glue.tasks` as a list; 'auto' = wordorder + each GLUE task with train and dev TSVs in data.glue_dir. Each
    GLUE task named needs its train and dev files there (a bucket folder is mirrored first), and an 'auto' that
    finds none in a data.glue_dir given is refused: both are found here, before any pretraining."""
    raw, given = str(config.glue.tasks).strip(), str(config.data.glue_dir or "")
    if raw == "auto":
        if not given:
            return ["wordorder"]
        local = local_glue_dir(config)
        found = [t for t in GLUE_CANDIDATES if has_train_and_dev(local, t)]
        require(bool(found), f"data.glue_dir {given} holds no GLUE task with train and dev files",
                "--config.data.glue_dir", "point it at the folder download_glue_data.py made (SST-2/, RTE/, ...), "
                "or leave it empty for the built-in word-order task alone")
        return ["wordorder"] + found
    tasks = [t.strip() for t in raw.split(",") if t.strip()]
    for task in tasks:
        require(task in data_lib.GLUE_TASKS, f"unknown GLUE task {task!r} in glue.tasks", "--config.glue.tasks",
                "use 'auto' or a comma-separated list of " + "|".join(data_lib.GLUE_TASKS))
        require(task == "wordorder" or bool(given), f"glue task {task!r} needs data.glue_dir",
                "--config.data.glue_dir", "point it at the GLUE TSVs, or use --config.glue.tasks=wordorder")
        if task != "wordorder":
            check_glue_task(config, task, "--config.glue.tasks")
    return tasks


def glue_config(config: ml_collections.ConfigDict, scheme: Scheme, seed: int, pretrain_path: str, task: str
                ) -> ml_collections.ConfigDict:
    """The fine-tuning config of (scheme, seed, task): `config.finetune` (configs/glue.py's sections) with the
    scheme's model/data/mesh, the suite's glue.* settings and the seed."""
    g = _glue_base(config, scheme, seed, pretrain_path, task)
    gl = config.glue
    n_train = len(data_lib.glue_examples(g, task, "train"))
    steps = int(gl.epochs) * max(n_train // int(gl.batch_size), 1)
    g.train.steps = min(steps, int(gl.max_steps)) if int(gl.max_steps) > 0 else steps
    return config_lib.lock(g)


def _glue_base(config: ml_collections.ConfigDict, scheme: Scheme, seed: int, pretrain_path: str, task: str
               ) -> ml_collections.ConfigDict:
    """`glue_config` but for train.steps (which reads the task's examples): every key `SET_PER_RUN` names."""
    sub = scheme_config(config, scheme, seed)
    g = ml_collections.ConfigDict({**config.finetune.to_dict(), "model": sub.model.to_dict(),
                                   "data": sub.data.to_dict(), "mesh": sub.mesh.to_dict()})
    g.task, g.init_from = task, pretrain_path
    gl = config.glue
    g.train.batch_size, g.train.learning_rate, g.train.seed = int(gl.batch_size), float(gl.learning_rate), int(seed)
    g.train.epochs, g.train.predict_test, g.train.log_every = int(gl.epochs), False, 50
    g.checkpoint.every = 100_000
    return g


def _check_same_finetune(path: str, g: ml_collections.ConfigDict) -> None:
    """Refuse to reuse a fine-tuning run made with other keys (e.g. another glue.max_steps or learning rate)."""
    refuse_other_config(path, g, ("model", "data", "train", "init_from"), ("train.log_every", "data.cache_dir"),
                         "fine-tuned", "--workdir", "use a fresh compare workdir for other settings of the fine-tunes "
                         "(glue.*, finetune.*, the data)")


def _check_same_source(path: str, pretrained: str) -> None:
    """Refuse to reuse a finished fine-tune whose pretraining checkpoint is gone or another now (the run was moved
    aside and trained again, as the suite advises for a bad checkpoint): its scores belong to weights that are no
    longer there. A results.json made before it recorded the checkpoint (`init_checkpoint`) is not checked."""
    done = os.path.join(path, "results.json")
    if not files.isfile(done):
        return
    made = files.read_json(done)
    saved = made.get("init_checkpoint") if isinstance(made, dict) else None
    if not saved:
        return
    step = made.get("init_step")
    now = workdir_lib.checkpoint_identity(pretrained, step)
    require(now == saved, f"{path} was fine-tuned from {pretrained} step {step} as saved then, and that checkpoint is "
            f"{'another one now (the run was trained again)' if now else 'no longer there'}", "--workdir",
            f"move {os.path.dirname(path)} aside (its fine-tunes are made again from the run as it is), or restore "
            "the run it was fine-tuned from")


def check_finetunes(config: ml_collections.ConfigDict, workdir: str, schemes: list[Scheme], seeds: list[int],
                    runs_root: str, tasks: list[str]) -> None:
    """Before any pretraining: every fine-tune already in the suite folder must be the one this suite would make
    (one made with other glue.* settings was found at its turn, after hours of pretraining), from the checkpoint its
    pretraining run holds."""
    for seed in seeds:
        for scheme in (s for s in schemes if s.objective == "mlm"):
            pretrained = run_path(runs_root, scheme, seed)
            for task in tasks:
                path = os.path.join(workdir, "glue", run_name(scheme, seed), task)
                if files.isfile(workdir_lib.config_path(path)):
                    _check_same_finetune(path, glue_config(config, scheme, seed, pretrained, task))
                    _check_same_source(path, pretrained)


def finetune_all(config: ml_collections.ConfigDict, workdir: str, schemes: list[Scheme],
                 runs: dict[int, list[dict]], tasks: list[str]) -> dict:
    """Fine-tune every (scheme, seed, task) of `tasks` not done yet; {scheme: {str(seed): {task: results.json}}}."""
    results: dict[str, dict] = {}
    for seed, infos in runs.items():
        for scheme, info in zip(schemes, infos):
            if scheme.objective == "mlm":       # a diverged run has nothing to fine-tune: no scores, no verdict
                results.setdefault(scheme.name, {})[str(seed)] = {} if info.get("diverged") else _finetune_tasks(
                    config, workdir, scheme, seed, info["path"], tasks)
    return results


def _finetune_tasks(config: ml_collections.ConfigDict, workdir: str, scheme: Scheme, seed: int, pretrained: str,
                    tasks: list[str]) -> dict:
    out_by_task = {}
    for task in tasks:
        path = os.path.join(workdir, "glue", run_name(scheme, seed), task)
        done = os.path.join(path, "results.json")
        g = glue_config(config, scheme, seed, pretrained, task)
        _check_same_finetune(path, g)
        _check_same_source(path, pretrained)
        if not os.path.isfile(done):
            print(f"[compare {config.suite}] fine-tuning {run_name(scheme, seed)} on {task}: "
                  f"{int(g.train.steps)} steps -> {path}", flush=True)
            start = time.time()
            out = finetune(g, path)
            if out.get("preempted"):
                raise Preempted(f"fine-tuning {task} of {run_name(scheme, seed)} stopped at step {out.get('step')}")
            out["seconds"] = time.time() - start
            files.write_json(done, out)   # record the time too
        out_by_task[task] = files.read_json(done)
    return out_by_task
