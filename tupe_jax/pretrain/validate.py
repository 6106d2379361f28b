"""The pretraining command's validator: each section is checked by the module that owns it."""
from __future__ import annotations

import jax
import ml_collections

from tupe_jax import data, files, model, optim, sharding, trainer
from tupe_jax.config import require_finite, require_positive, require_seed
from tupe_jax.errors import UserError, require, warn_once
from tupe_jax.finetune import init_from


def validate(config: ml_collections.ConfigDict, num_devices: int) -> tuple[int, int, int]:
    """Check a pretraining config against `num_devices` before any compute; return the mesh (data, fsdp, tensor)."""
    require_finite(config)
    model.validate_config(config.model)
    model.validate_training(config, jax.default_backend(), (config.model.max_len,))
    mesh = sharding.resolve_mesh_shape(config.mesh, num_devices)
    sharding.check_model(config.model, mesh)
    sharding.warn_miscompiled_mesh(mesh, jax.default_backend())
    require_positive(config, ("train.steps", "train.batch_size", "train.grad_accum_steps", "train.log_every"))
    require_positive(config, ("train.warmup_steps", "train.decay_steps", "train.eval_every", "train.eval_steps"),
                     allow_zero=True)
    optim.validate_config(config.train)
    sharding.check_batch(config.train, mesh)
    require_seed(config)
    profile = trainer.parse_profile_steps(config.train.get("profile_steps", ""))
    steps = int(config.train.steps)
    require(profile is None or profile[1] <= steps, f"train.profile_steps = {config.train.get('profile_steps')!r} "
            f"ends after the run's last step (train.steps = {steps})", "--config.train.profile_steps",
            f"give a range within 1..{steps}")
    span, warmup = optim.schedule_span(steps, config.train.decay_steps, config.train.warmup_steps)
    if span < steps:      # a run extended with the old schedule kept (README): the steps past it do not learn
        warn_once(f"warning: train.decay_steps = {config.train.decay_steps} ends the schedule before train.steps = "
                  f"{steps}: steps {span + 1} to {steps} train at learning rate 0 (the weights do not change)")
    if warmup < int(config.train.warmup_steps):     # learning_rate_fn cuts it: say so (smoke runs do this)
        warn_once(f"warning: train.warmup_steps = {config.train.warmup_steps} is longer than the schedule's {span} "
                   f"steps; the warmup is cut to {span} (the rate peaks at the last step)")
    require_positive(config, ("checkpoint.every", "checkpoint.keep"))
    if "metrics" in config:
        require_positive(config, ("metrics.peak_tflops",), allow_zero=True)   # 0: looked up from the device kind
    data.validate_config(config)
    init_from.validate_keys(config)
    require(not (config.get("init_from", "") and config.data.get("vocab_file", "")), "data.vocab_file given with init_from: "
            "a continued run keeps the tokenizer of the run it continues", "--config.data.vocab_file",
            "drop data.vocab_file (init_from's tokenizer/vocab.txt is copied into the run)")
    return mesh


# Keys a causal LM does not read (its examples are contiguous windows, every token a target): given on the command
# line for a new causal run they would change nothing, so they are refused rather than ignored.
MLM_ONLY = {"data.mask_prob": "masking", "data.max_predictions": "masking", "data.packing": "packing"}


def adopt(config: ml_collections.ConfigDict, arg_keys: frozenset, override_keys: frozenset,
          workdir: str = "") -> list[str]:
    """The launcher's hook: with `init_from`, that run's model keys the command line left to the presets
    (`init_from.adopt_model_keys`, returned); then `refuse_unread_keys` for the objective they give."""
    adopted = init_from.adopt_model_keys(config, arg_keys, override_keys, workdir=workdir)
    refuse_unread_keys(config, arg_keys, override_keys, workdir=workdir)
    return adopted


def refuse_unread_keys(config: ml_collections.ConfigDict, arg_keys: frozenset, override_keys: frozenset,
                       workdir: str = "") -> list:
    """The launcher's hook: an override of a key `config`'s objective does not read is refused for a new run; a run
    already in `workdir` (made before this check) resumes with its own keys, which the workdir gate compares.
    Nothing is set."""
    del arg_keys
    if str(config.model.objective) == "clm" and not (workdir and files.isfile(files.join(workdir, "config.json"))):
        for key in sorted(override_keys & set(MLM_ONLY)):
            raise UserError(f"{key} is read by MLM {MLM_ONLY[key]} only; objective=clm trains on contiguous windows "
                            "with every token a target", f"--config.{key}", "drop it, or pretrain an MLM (objective=mlm)")
    return []
