"""The fine-tuning commands' validator (`finetune`, `glue-sweep`) and the task helpers it shares with the loop."""
from __future__ import annotations

import math

import jax
import ml_collections

from tupe_jax import model, optim, sharding
from tupe_jax.config import SEED_LIMIT, require_finite, require_positive, require_seed
from tupe_jax.data import GLUE_TASKS
from tupe_jax.data.classification import batch_widths
from tupe_jax.errors import require
from tupe_jax.finetune import init_from

PAPER_EPOCHS = {"mnli": 5, "qnli": 5, "qqp": 5}  # everything else: 10 (TUPE App. B)


def paper_epochs(task: str) -> int:
    """Epochs of the TUPE protocol: 5 for MNLI, QNLI, QQP; 10 otherwise."""
    return PAPER_EPOCHS.get(task, 10)


def validate(config: ml_collections.ConfigDict, num_devices: int) -> tuple[int, int, int]:
    """Check a fine-tuning config against `num_devices` before any compute; return the mesh (data, fsdp, tensor)."""
    require_finite(config)
    model.validate_config(config.model)
    model.validate_training(config, jax.default_backend(), batch_widths(config, int(config.model.max_len)))
    require(config.model.objective == "mlm", f"model.objective={config.model.objective!r}: the classifier reads "
            "[CLS] at position 0, which a causal decoder computes without seeing the rest of the text",
            "--config.model.objective", "fine-tune an MLM (bidirectional) run")
    mesh = sharding.resolve_mesh_shape(config.mesh, num_devices)
    sharding.check_model(config.model, mesh)
    sharding.warn_miscompiled_mesh(mesh, jax.default_backend())
    require(config.task in GLUE_TASKS, f"unknown GLUE task {config.task!r}", "--config.task",
            "use one of " + "|".join(GLUE_TASKS))
    require_positive(config, ("train.batch_size", "train.eval_batch_size", "train.grad_accum_steps",
                              "train.log_every"))
    require_positive(config, ("train.epochs", "train.steps", "train.eval_every"), allow_zero=True)
    require(0.0 <= config.train.warmup_ratio < 1.0, f"train.warmup_ratio = {config.train.warmup_ratio} is outside "
            "[0, 1)", "--config.train.warmup_ratio", "use e.g. 0.06")
    optim.validate_config(config.train)
    require_seed(config)
    init_from.validate_keys(config)
    sharding.check_batch(config.train, mesh)
    require(config.checkpoint.every > 0 and config.checkpoint.keep > 0, "checkpoint.every and checkpoint.keep must "
            "be positive", "--config.checkpoint.every", "give positive values")
    require(len(config.sweep.learning_rates) > 0 and all(float(x) > 0 for x in config.sweep.learning_rates),
            f"sweep.learning_rates = {config.sweep.learning_rates} needs positive values",
            "--config.sweep.learning_rates", "write e.g. '(2e-5,3e-5)'")
    require(len(config.sweep.seeds) > 0, "sweep.seeds is empty", "--config.sweep.seeds", "write e.g. '(0,1,2)'")
    bad = [s for s in config.sweep.seeds if not 0 <= int(s) < SEED_LIMIT]
    require(not bad, f"sweep.seeds holds {bad[0] if bad else ''}, outside [0, 2**32)", "--config.sweep.seeds",
            "give non-negative seeds below 2**32, e.g. '(0,1,2)'")
    require(bool(sweep_tasks(config)), f"sweep.tasks = {config.sweep.tasks!r} names no task", "--config.sweep.tasks",
            "give e.g. rte,mrpc, or leave it empty to sweep config.task")
    for task in sweep_tasks(config):
        require(task in GLUE_TASKS, f"unknown GLUE task {task!r} in sweep.tasks", "--config.sweep.tasks",
                "use a comma-separated list of " + "|".join(GLUE_TASKS))
    _distinct("sweep.learning_rates", [(f"lr={float(x):g}", x) for x in config.sweep.learning_rates],
              "give values that differ in their first 6 significant digits")
    _distinct("sweep.seeds", [(f"seed={int(x)}", x) for x in config.sweep.seeds], "give each seed once")
    _distinct("sweep.tasks", [(t, t) for t in sweep_tasks(config)], "give each task once")
    return mesh


def _distinct(key: str, named: list[tuple[str, object]], fix: str) -> None:
    """Each sweep value has its own sub-run folder (`sweep.run_dir`): two values naming one folder would train once
    and report the first run's scores for both."""
    seen: dict[str, object] = {}
    for folder, value in named:
        require(folder not in seen, f"{key} holds {seen.get(folder)!r} and {value!r}, which name the same sub-run "
                f"folder {folder}", f"--config.{key}", fix)
        seen[folder] = value


def sweep_tasks(config: ml_collections.ConfigDict) -> list[str]:
    """`sweep.tasks` as a list ('' = [config.task])."""
    raw = str(config.sweep.tasks or "").strip()
    return [t.strip() for t in raw.split(",") if t.strip()] if raw else [str(config.task)]


def schedule_section(config: ml_collections.ConfigDict, total_steps: int) -> ml_collections.ConfigDict:
    """The `train`-like section `optim.make_optimizer` reads: warmup = ceil(ratio x steps), linear decay to 0."""
    t = config.train
    return ml_collections.ConfigDict(dict(
        learning_rate=float(t.learning_rate), steps=int(total_steps), decay_steps=0,
        warmup_steps=int(math.ceil(float(t.warmup_ratio) * total_steps)), weight_decay=float(t.weight_decay),
        clip_norm=float(t.clip_norm), adam_b1=float(t.adam_b1), adam_b2=float(t.adam_b2),
        adam_eps=float(t.adam_eps)))
