"""Fine-tuning helpers: config validation, `init_from` resolution, the pretraining run's tokenizer, the
compatibility checks (scheme, model keys, encoder shapes), and the params-only encoder restore.

A pretraining checkpoint's state item is `{'step', 'params', 'opt_state', 'rng'}` with params of a `TransformerLM`
(`{'encoder', 'head_dense', 'head_ln', 'head_bias'}`). A `SequenceClassifier` has the same `encoder` subtree, so
only `params['encoder']` is read (an Orbax partial restore straight onto the fine-tune shardings); `pooler` and
`classifier` keep their fresh initialisation, and the optimizer state starts fresh.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from typing import Any

import jax
import ml_collections

from tupe_jax import checkpoint as ckpt_lib
from tupe_jax import config as config_lib
from tupe_jax.errors import UserError, require

PAPER_EPOCHS = {"mnli": 5, "qnli": 5, "qqp": 5}  # everything else: 10 (TUPE App. B)
# Model keys that must equal the pretraining run's (they change parameter shapes or what the parameters mean).
# dtype, dropout rates and the attention backend may differ.
MUST_MATCH = ("pe", "objective", "num_layers", "hidden_size", "num_heads", "mlp_dim", "vocab_size", "max_len",
              "untie_cls", "rel_num_buckets", "rel_max_distance", "rope_base", "rope_style", "rope_fraction",
              "layer_norm_eps", "tupe_form")
WHERE = "--config.init_from"


def paper_epochs(task: str) -> int:
    """Epochs of the TUPE protocol: 5 for MNLI, QNLI, QQP; 10 otherwise."""
    return PAPER_EPOCHS.get(task, 10)


def validate_glue(config: ml_collections.ConfigDict, num_devices: int) -> tuple[int, int, int]:
    """The fine-tuning counterpart of `config.validate`: model, mesh, task, train and sweep keys."""
    from tupe_jax.data import GLUE_TASKS  # pylint: disable=import-outside-toplevel
    config_lib.validate_model(config.model)
    data, fsdp, _ = shape = config_lib.resolve_mesh_shape(config.mesh, num_devices)
    require(config.task in GLUE_TASKS, f"unknown GLUE task {config.task!r}", "--config.task",
            "use one of " + "|".join(GLUE_TASKS))
    t = config.train
    for key in ("batch_size", "eval_batch_size", "learning_rate", "grad_accum_steps", "log_every", "adam_eps"):
        require(t[key] > 0, f"train.{key} = {t[key]} must be positive", f"--config.train.{key}", "give a positive value")
    for key in ("epochs", "steps", "eval_every", "weight_decay", "clip_norm"):
        require(t[key] >= 0, f"train.{key} = {t[key]} must be >= 0", f"--config.train.{key}", "give 0 or more")
    require(0.0 <= t.warmup_ratio < 1.0, f"train.warmup_ratio = {t.warmup_ratio} is outside [0, 1)",
            "--config.train.warmup_ratio", "use e.g. 0.06")
    for key in ("adam_b1", "adam_b2"):
        require(0.0 <= t[key] < 1.0, f"train.{key} = {t[key]} is outside [0, 1)", f"--config.train.{key}",
                "use e.g. 0.9 / 0.999")
    if "dropout_rng" in t:
        config_lib.require_one_of(t.dropout_rng, config_lib.DROPOUT_RNGS, "train.dropout_rng")
    shards = data * fsdp
    require(t.batch_size % t.grad_accum_steps == 0,
            f"train.grad_accum_steps = {t.grad_accum_steps} does not divide train.batch_size = {t.batch_size}",
            "--config.train.grad_accum_steps", "pick a divisor of the batch size")
    require((t.batch_size // t.grad_accum_steps) % shards == 0,
            f"train.batch_size = {t.batch_size} (microbatch {t.batch_size // t.grad_accum_steps}) is not divisible "
            f"by the data-parallel size mesh.data*mesh.fsdp = {shards}", "--config.train.batch_size",
            f"use a multiple of {shards * t.grad_accum_steps}")
    require(t.eval_batch_size % shards == 0,
            f"train.eval_batch_size = {t.eval_batch_size} is not divisible by mesh.data*mesh.fsdp = {shards}",
            "--config.train.eval_batch_size", f"use a multiple of {shards}")
    require(config.checkpoint.every > 0 and config.checkpoint.keep > 0, "checkpoint.every and checkpoint.keep must "
            "be positive", "--config.checkpoint.every", "give positive values")
    require(len(config.sweep.learning_rates) > 0 and all(float(x) > 0 for x in config.sweep.learning_rates),
            f"sweep.learning_rates = {config.sweep.learning_rates} needs positive values",
            "--config.sweep.learning_rates", "write e.g. '(2e-5,3e-5)'")
    require(len(config.sweep.seeds) > 0, "sweep.seeds is empty", "--config.sweep.seeds", "write e.g. '(0,1,2)'")
    for task in sweep_tasks(config):
        require(task in GLUE_TASKS, f"unknown GLUE task {task!r} in sweep.tasks", "--config.sweep.tasks",
                "use a comma-separated list of " + "|".join(GLUE_TASKS))
    return shape


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


# ------------------------------------------------------------------------------------------------ init_from
@dataclasses.dataclass(frozen=True)
class InitSource:
    workdir: str          # the pretraining run
    step: int             # the checkpoint step to read
    meta: dict[str, Any]  # the checkpoint's meta item


def resolve_init_from(path: str, init_step: int = -1) -> tuple[str, int | None]:
    """(pretraining workdir, step or None = latest) from a workdir, its checkpoints dir, or checkpoints/<step>."""
    path = os.path.abspath(os.path.expanduser(path))
    base, name = os.path.split(path.rstrip(os.sep))
    step = None if init_step < 0 else int(init_step)
    if os.path.isdir(os.path.join(path, "checkpoints")):
        workdir = path
    elif name.isdigit() and os.path.basename(base) == "checkpoints" and os.path.isdir(path):
        workdir, step = os.path.dirname(base), int(name)
    elif name == "checkpoints" and os.path.isdir(path):
        workdir = base
    else:
        raise UserError(f"init_from {path} is not a pretraining run (no checkpoints/ there)", WHERE,
                        "point it at a `launch pretrain` workdir or its checkpoints/<step>, or leave it empty to "
                        "train from scratch")
    return workdir, step


def open_init_source(config: ml_collections.ConfigDict) -> InitSource:
    """Resolve `config.init_from`, pick the step, read its meta and refuse another scheme or model shape."""
    workdir, step = resolve_init_from(str(config.init_from), int(config.init_step))
    checkpointer = ckpt_lib.Checkpointer(workdir, read_only=True, async_=False)
    try:
        steps = checkpointer.all_steps()
        require(bool(steps), f"no checkpoints in {checkpointer.directory}", WHERE, "pretrain first")
        if step is None:
            step = steps[-1]
        require(step in steps, f"no checkpoint at step {step} in {checkpointer.directory}", WHERE,
                f"use one of {steps}")
        meta = checkpointer.restore_meta(step)
    finally:
        checkpointer.close()
    ckpt_lib.check_compatible(meta, str(config_lib.PE_ALIASES.get(config.model.pe, config.model.pe)), where=WHERE)
    check_model_keys(workdir, config)
    return InitSource(workdir, int(step), meta)


def check_model_keys(pretrain_workdir: str, config: ml_collections.ConfigDict) -> None:
    """Refuse a pretraining run whose config.json has other shape-defining model keys, naming both values."""
    path = os.path.join(pretrain_workdir, "config.json")
    if not os.path.isfile(path):
        return  # the param-shape check in `check_encoder_shapes` still runs
    with open(path, encoding="utf-8") as f:
        try:
            old = json.load(f).get("model", {})
        except json.JSONDecodeError:
            return
    diffs = [(k, old[k], config.model[k]) for k in MUST_MATCH if k in old and k in config.model
             and old[k] != config.model[k]]
    if diffs:
        theirs = ", ".join(f"model.{k}={a!r}" for k, a, _ in diffs)
        ours = ", ".join(f"model.{k}={b!r}" for k, _, b in diffs)
        raise UserError(f"init_from {pretrain_workdir} was pretrained with {theirs} but this config has {ours}",
                        WHERE, "use the pretraining run's size/pe (configs/glue.py:pe=...,size=...) and "
                        "--config.model.* overrides")


def check_encoder_shapes(meta: dict[str, Any], abstract_encoder: Any) -> None:
    """Refuse a checkpoint whose encoder param shapes differ from this model's, naming both shapes."""
    saved = {k: v for k, v in meta.get("param_shapes", {}).items() if k.startswith("['encoder']")}
    if not saved:
        return
    ours = ckpt_lib.param_shapes({"encoder": abstract_encoder})
    missing = sorted(set(ours) - set(saved))
    extra = sorted(set(saved) - set(ours))
    if missing or extra:
        raise UserError(f"the checkpoint's encoder has other parameters (checkpoint only: {extra[:3]}, this model "
                        f"only: {missing[:3]})", WHERE, "use the pretraining run's model.* keys (size, pe, layers)")
    for key, shape in ours.items():
        if list(saved[key]) != list(shape):
            raise UserError(f"encoder param {key} has shape {saved[key]} in the checkpoint but {list(shape)} here",
                            WHERE, "use the same model size (model.* keys) as the pretraining run")


def restore_encoder(source: InitSource, abstract_encoder: Any) -> Any:
    """Read only `params['encoder']` of the pretraining checkpoint onto the shardings of `abstract_encoder`
    (unboxed ShapeDtypeStructs carrying shardings)."""
    check_encoder_shapes(source.meta, abstract_encoder)
    restored = ckpt_lib.restore_params(source.workdir, source.step, abstract_params={"encoder": abstract_encoder})
    return restored["encoder"]


# ------------------------------------------------------------------------------------------------ tokenizer
def adopt_tokenizer(pretrain_workdir: str, workdir: str) -> str:
    """Copy the pretraining run's tokenizer into `workdir/tokenizer/` (process 0) and return the pretraining run's
    vocab.txt path (every process loads that); refuse a different tokenizer already in `workdir`."""
    src = os.path.join(pretrain_workdir, "tokenizer", "vocab.txt")
    require(os.path.isfile(src), f"the pretraining run {pretrain_workdir} has no tokenizer/vocab.txt", WHERE,
            "point init_from at a workdir made by `launch pretrain`")
    dst_dir = os.path.join(workdir, "tokenizer")
    dst = os.path.join(dst_dir, "vocab.txt")
    with open(src, encoding="utf-8") as f:
        wanted = f.read()
    if os.path.isfile(dst):
        with open(dst, encoding="utf-8") as f:
            if f.read() != wanted:
                raise UserError(f"{dst} differs from the pretraining run's tokenizer {src}", "--workdir",
                                "use a fresh workdir for a fine-tune of another pretraining run")
        return src
    if jax.process_index() == 0:
        os.makedirs(dst_dir, exist_ok=True)
        for name in os.listdir(os.path.dirname(src)):
            shutil.copy2(os.path.join(os.path.dirname(src), name), os.path.join(dst_dir, name))
    return src
