"""The pretraining loop: `pretrain(config, workdir)`, top to bottom, over `trainer.Trainer`.

The train step is `jax.jit` with explicit in/out shardings on a ('data', 'fsdp', 'tensor') mesh and a donated
state; metrics come back one step late, so the host never waits on the step it just dispatched. Restarting on
the same workdir resumes from the newest good checkpoint (params, optimizer, step, RNG, data-iterator position).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Iterator, Optional

import jax
import ml_collections

from tupe_jax import checkpoint as ckpt_lib
from tupe_jax import data as data_lib
from tupe_jax import files, local_staging
from tupe_jax import metrics as metrics_lib
from tupe_jax import sharding as sharding_lib
from tupe_jax import trainer as trainer_lib
from tupe_jax import workdir as workdir_lib
from tupe_jax import xla_options
from tupe_jax.errors import UserError, require
from tupe_jax.finetune import init_from
from tupe_jax.model import ModelConfig, TransformerLM
from tupe_jax.optim import make_optimizer
from tupe_jax.pretrain import steps
from tupe_jax.pretrain.validate import validate

log = logging.getLogger(__name__)


def validation_batches(config: ml_collections.ConfigDict, tokenizer, batch_size: int) -> Optional[Iterator]:
    """One pass over the validation split, or None when the corpus has none."""
    try:
        return data_lib.pretrain_iterator(config, tokenizer, split="validation", global_batch_size=batch_size,
                                          seed=0, shuffle=False, repeat=False)
    except UserError as err:
        if "validation" in str(err):
            log.warning("no validation split (%s): the run trains without validation losses", err.what)
            return None
        raise


def pretrain(config: ml_collections.ConfigDict, workdir: str, stop_after: Optional[int] = None,
             devices: Optional[list] = None) -> dict[str, Any]:
    """Train `config` in `workdir`, resuming from its latest good checkpoint. Returns the final metrics.

    `stop_after`: behave as if preempted after that many steps of this invocation (checkpoint, return).
    `devices`: the devices of the mesh (default: all; the launcher always uses all).
    """
    devices = list(devices) if devices is not None else jax.devices()
    validate(config, len(devices))
    data_lib.refuse_inside_corpus(config, workdir, "--workdir", "train into")
    with workdir_lib.claim(workdir, config):   # the gate: same run, one process, cleanup after a failure
        return _pretrain(config, workdir, devices, stop_after)


def _pretrain(config: ml_collections.ConfigDict, workdir: str, devices: list, stop_after: Optional[int]) -> dict:
    # --------------------------------------------------------------------------------------- setup
    mesh = sharding_lib.make_mesh(config, devices)
    checkpointer = ckpt_lib.Checkpointer(workdir, every=int(config.checkpoint.every), keep=int(config.checkpoint.keep),
                                         async_=bool(config.checkpoint.async_save))
    # init_from is read until the run has a checkpoint of its own; from then on the run resumes from that
    continued = bool(config.get("init_from", ""))     # a config.json made before the key has none
    try:
        source = init_from.open_init_source(config) if continued and checkpointer.latest_step() is None else None
        tokenizer = data_lib.get_tokenizer(config, workdir) if source is None else _adopted_tokenizer(config, source,
                                                                                                       workdir)
    except BaseException:       # a refused source or tokenizer: the checkpointer's threads end with the command
        checkpointer.close()
        raise
    model = TransformerLM(ModelConfig.from_config(config.model))
    causal = model.cfg.causal
    tx, schedule = make_optimizer(config.train)
    total_steps, batch_size = int(config.train.steps), int(config.train.batch_size)

    # --------------------------------------------------------------------------------------- state
    step_fn = steps.make_train_step(model, tx, schedule, int(config.train.grad_accum_steps),
                                    str(config.train.get("dropout_rng", "threefry2x32")))
    trainer = trainer_lib.Trainer(
        trainer_lib.init_state_fn(model, tx, int(config.model.max_len)), int(config.train.seed), mesh, step_fn,
        checkpointer, meta=lambda s: workdir_lib.make_meta(config, s["params"], tokenizer.fingerprint),
        log_every=int(config.train.log_every), profile=_profile(config, workdir))
    read: list[init_from.InitSource] = []     # the checkpoint a fresh continued run started from

    def continue_from(state: dict) -> dict:
        state["params"], got = init_from.restore(source, trainer.abstract_params)
        read.append(got)
        print(f"{workdir}: every param from {got.workdir} step {got.step}; the optimizer, the schedule and the "
              "data start at step 0", flush=True)
        return state

    state, data_state = trainer.restore_or_init(fresh=continue_from if source is not None else None)
    start_step = int(state["step"])
    if data_state == {}:     # import-hf / import-fairseq save none: the data and train keys there are placeholders
        checkpointer.close()
        raise UserError(f"{workdir} holds an imported model (checkpoint {start_step} has no data-iterator state): "
                        "its config.json keeps this project's default data and train keys, not the model's own",
                        "--workdir", f"continue it in a fresh workdir with --config.init_from={workdir}, fine-tune "
                        "it (--config.init_from) or analyse it")
    try:     # the text and tokenizer it trained on, also for a finished run (a data.path now naming other text
        if data_state is not None:      # would be written into its config.json); other text before it is tokenized
            workdir_lib.check_tokenizer(checkpointer.restore_meta(start_step), tokenizer.fingerprint,
                                        workdir_lib.tokenizer_path(workdir))
            data_lib.pipeline.check_saved_text(config, data_state)
        train_iter = data_lib.pretrain_iterator(config, tokenizer, split="train", global_batch_size=batch_size,
                                                seed=int(config.train.seed))
        if data_state is not None:
            train_iter.set_state(data_state)
    except BaseException:
        checkpointer.close()
        raise
    finished = start_step >= total_steps
    if finished and not _final_eval_missing(config, workdir, tokenizer, start_step, batch_size):
        print(f"{workdir} is at step {start_step} (train.steps = {total_steps}): nothing to train; evaluate it with "
              f"`python -m launch evaluate --workdir={workdir}`, or give a larger train.steps", flush=True)
        checkpointer.close()   # a finished run: nothing is written (no event, no TensorBoard file)
        return {"step": start_step}
    writer = metrics_lib.MetricsWriter(workdir, owns_folder=lambda: workdir_lib.owns_folder(workdir))
    if data_state is not None:
        print(f"{workdir} is at step {start_step}: writing the final evaluation its run stopped before" if finished
              else f"resumed from step {start_step} of {workdir}", flush=True)
        before = train_iter.saved_process_count        # read from the state, or its key for a state without it
        moved = {"process_count_before": before, "process_count": jax.process_count()} \
            if before != jax.process_count() else {}
        writer.write(start_step, {"event": metrics_lib.RESUMED, **moved})   # later rows of the old process: redone
    elif metrics_lib.rows_past(workdir, 0):
        print(f"{workdir} has no checkpoint yet: training from step 0 again", flush=True)
        writer.write(0, {"event": metrics_lib.RESUMED})
    for got in read:       # which checkpoint, where init_step left it to the newest
        writer.write(0, {"event": "init_from", "init_from": got.workdir, "init_step": got.step})

    # --------------------------------------------------------------------------------------- hooks
    eval_step = xla_options.jit(sharding_lib.with_activation_layout(steps.make_eval_step(model), mesh),
                                in_shardings=(trainer.shardings["params"], sharding_lib.batch_sharding(mesh)))
    flops = steps.step_flops(config)
    peak = metrics_lib.peak_tflops(float(config.metrics.peak_tflops))
    tokens_per_step = batch_size * int(config.model.max_len)
    progress = metrics_lib.Progress(total_steps, start_step)
    eval_every = int(config.train.eval_every)
    last_logged: dict[str, Any] = {}

    def log_step(step: int, values: dict) -> None:
        values = dict(values)
        if causal:
            values["perplexity"] = math.exp(min(values["loss"], 80.0))
        else:
            values["mlm_accuracy"] = values.pop("accuracy")
        step_time = values.pop("step_time_s")
        values.update(step_time_s=step_time, tokens_per_sec=tokens_per_step / step_time,
                      model_tflops=flops / step_time / 1e12)
        if peak > 0:
            values["mfu"] = metrics_lib.mfu(flops, step_time, len(devices), peak)
        writer.write(step, values)
        progress.line(step, {k: values[k] for k in ("loss", "learning_rate") if k in values})
        last_logged.clear()
        last_logged.update(values)

    def write_eval(step: int, params: Any) -> dict[str, float]:
        batches = validation_batches(config, tokenizer, batch_size)
        if batches is None:
            return {}
        values = steps.summarize(steps.run_eval(eval_step, params, batches, mesh, int(config.train.eval_steps)),
                                 causal, prefix="eval_")
        writer.write(step, values)
        print(f"step {step} | " + " | ".join(f"{k} {v:.4f}" for k, v in values.items()), flush=True)
        return values

    def after_step(step: int, state: dict) -> None:
        if eval_every > 0 and step % eval_every == 0 and step < total_steps:
            write_eval(step, state["params"])

    # --------------------------------------------------------------------------------------- loop
    def payload() -> dict:   # at every checkpoint: the metrics so far are stored too (a bucket rewrites them)
        writer.flush()
        return train_iter.get_state()

    hooks = trainer_lib.Hooks(log=log_step, after_step=after_step, payload=payload,
                              sync_due=lambda s: eval_every > 0 and s % eval_every == 0)
    with metrics_lib.closed_on_error(writer):
        outcome = trainer.fit(state, train_iter, total_steps, hooks, stop_after=stop_after)

        # ----------------------------------------------------------------------------------- finish
        final: dict[str, Any] = {"step": outcome.step, **last_logged}
        if not outcome.preempted and outcome.step >= total_steps:   # also a run that stopped just before it
            final.update(write_eval(outcome.step, outcome.state["params"]))
    checkpointer.close()
    writer.close()
    return final


def _adopted_tokenizer(config: ml_collections.ConfigDict, source: init_from.InitSource, workdir: str):
    """init_from's tokenizer, copied into `workdir/tokenizer/`; a prepared directory must have been made with it."""
    tokenizer = data_lib.Tokenizer.from_file(init_from.adopt_tokenizer(source.workdir, workdir))
    if config.data.get("name", "") == "prepared":
        require(data_lib.get_tokenizer(config, None).fingerprint == tokenizer.fingerprint,
                f"{config.data.path} was prepared with another tokenizer than init_from's ({source.workdir})",
                "--config.data.path", f"prepare the corpus with --config.data.vocab_file="
                f"{files.join(source.workdir, 'tokenizer', 'vocab.txt')} into a fresh directory")
    return tokenizer


def _final_eval_missing(config: ml_collections.ConfigDict, workdir: str, tokenizer, step: int,
                        batch_size: int) -> bool:
    """A finished run (at `step`) without its final evaluation row: it stopped (preempted, killed) after its last
    checkpoint and before evaluating. Rows of `launch evaluate` (they name their split) do not count."""
    return validation_batches(config, tokenizer, batch_size) is not None and not metrics_lib.has_eval_at(workdir, step)


def _profile(config: ml_collections.ConfigDict, workdir: str) -> Optional[trainer_lib.Profile]:
    """`train.profile_steps` -> a trace of those steps in `workdir/profile` (TensorBoard's profile plugin / xprof read
    it); in a bucket, staged in a local temporary folder and uploaded after the trace."""
    steps = trainer_lib.parse_profile_steps(config.train.get("profile_steps", ""))
    if steps is None:
        return None
    target = files.join(workdir, "profile")
    if not files.is_remote(workdir):
        return trainer_lib.Profile(*steps, target)
    return trainer_lib.Profile(*steps, local_staging.make("profile"), target)
