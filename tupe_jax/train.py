"""Pretraining: one loop, top to bottom, over small libraries (model, data, sharding, checkpoint, optim, metrics).

    pretrain(config, workdir)   train (or resume) a run; the main job behind `python -m launch pretrain`
    evaluate(workdir, step)     restore a checkpoint and report validation loss / accuracy / perplexity
    load_run(workdir, step)     config + model + params + tokenizer of a finished run (for analysis)
    demo(workdir)               the README's first command: a tiny TUPE-R MLM on the embedded corpus

The train step is `jax.jit` with explicit in/out shardings on a ('data', 'fsdp', 'tensor') mesh and a donated
state; metrics come back one step late, so the host never waits on the step it just dispatched.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Any, Callable, Iterator, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from tupe_jax import checkpoint as ckpt_lib
from tupe_jax import config as config_lib
from tupe_jax import data as data_lib
from tupe_jax import metrics as metrics_lib
from tupe_jax import sharding as sharding_lib
from tupe_jax.errors import UserError
from tupe_jax.model import ModelConfig, TransformerLM
from tupe_jax.optim import accumulate_gradients, dropout_key, make_optimizer

log = logging.getLogger(__name__)
Batch = dict[str, jax.Array]


# ================================================================================================ losses
def batch_loss(model: TransformerLM, params: Any, batch: Batch, rng: jax.Array, deterministic: bool):
    """(Σ token NLL, {'weight': Σ weights, 'correct': Σ weighted hits}) for an MLM or CLM batch."""
    if model.cfg.causal:
        logits = model.apply({"params": params}, batch["inputs"], deterministic=deterministic,
                             rngs={"dropout": rng})["logits"]
        labels, weights = batch["targets"], batch["weights"]
    else:
        logits = model.apply({"params": params}, batch["inputs"], input_mask=batch["input_mask"],
                             mlm_positions=batch["mlm_positions"], deterministic=deterministic,
                             rngs={"dropout": rng})["logits"]
        labels, weights = batch["mlm_labels"], batch["mlm_weights"]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    return jnp.sum(nll * weights), {"weight": jnp.sum(weights), "correct": jnp.sum(correct * weights)}


def summarize(sums: dict[str, float], causal: bool, prefix: str = "") -> dict[str, float]:
    """Loss and accuracy (MLM) or perplexity (CLM) from summed statistics."""
    weight = max(float(sums["weight"]), 1e-9)
    loss = float(sums["loss_sum"]) / weight
    out = {f"{prefix}loss": loss}
    if causal:
        out[f"{prefix}perplexity"] = math.exp(min(loss, 80.0))
    else:
        out[f"{prefix}mlm_accuracy"] = float(sums["correct"]) / weight
    return out


# ================================================================================================ steps
def make_train_step(model: TransformerLM, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    grad_accum_steps: int, dropout_rng: str = "threefry2x32") -> Callable:
    def train_step(state: dict, batch: Batch) -> tuple[dict, dict]:
        rng = jax.random.fold_in(state["rng"], state["step"])
        loss_fn = lambda p, b, r: batch_loss(model, p, b, dropout_key(r, dropout_rng), deterministic=False)  # noqa
        loss, grads, aux = accumulate_gradients(loss_fn, state["params"], batch, grad_accum_steps, rng)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
                     "opt_state": opt_state, "rng": state["rng"]}
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "learning_rate": schedule(state["step"]),
                   "accuracy": aux["correct"] / jnp.maximum(aux["weight"], 1e-9)}
        return new_state, metrics
    return train_step


def make_eval_step(model: TransformerLM) -> Callable:
    def eval_step(params: Any, batch: Batch) -> dict:
        loss_sum, aux = batch_loss(model, params, batch, jax.random.PRNGKey(0), deterministic=True)
        return {"loss_sum": loss_sum, **aux}
    return eval_step


def run_eval(eval_step: Callable, params: Any, batches: Iterator[dict], mesh, max_batches: int) -> dict[str, float]:
    """Sum eval statistics over up to `max_batches` batches (all if <= 0)."""
    totals: dict[str, float] = {"loss_sum": 0.0, "weight": 0.0, "correct": 0.0}
    for i, batch in enumerate(batches):
        if 0 < max_batches <= i:
            break
        sums = jax.device_get(eval_step(params, sharding_lib.global_batch(batch, mesh)))
        for key in totals:
            totals[key] += float(sums[key])
    return totals


# ================================================================================================ setup helpers
def build_model(config: ml_collections.ConfigDict) -> tuple[ModelConfig, TransformerLM]:
    cfg = ModelConfig.from_config(config.model)
    return cfg, TransformerLM(cfg)


def init_state_fn(model: TransformerLM, tx: optax.GradientTransformation, config: ml_collections.ConfigDict):
    """rng -> boxed train state {'step', 'params', 'opt_state', 'rng'} (for eval_shape and sharded init)."""
    dummy = jnp.zeros((1, min(int(config.model.max_len), 8)), jnp.int32)

    def init(rng: jax.Array) -> dict:
        init_rng, dropout_rng = jax.random.split(rng)
        params = model.init({"params": init_rng}, dummy)["params"]
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
                "rng": dropout_rng}
    return init


def prediction_slots(config: ml_collections.ConfigDict) -> int:
    from tupe_jax.data.pipeline import resolve_max_predictions  # pylint: disable=import-outside-toplevel
    return resolve_max_predictions(config, int(config.model.max_len))


def step_flops(config: ml_collections.ConfigDict) -> float:
    m = config.model
    causal = m.objective == "clm"
    return metrics_lib.transformer_training_flops(
        m.num_layers, m.hidden_size, m.mlp_dim, m.vocab_size, m.max_len, config.train.batch_size, causal=causal,
        mlm_predictions=None if causal else prediction_slots(config))


def validation_batches(config, tokenizer, batch_size: int) -> Optional[Iterator[dict]]:
    """One pass over the validation split, or None when the corpus has none."""
    try:
        return data_lib.pretrain_iterator(config, tokenizer, split="validation", global_batch_size=batch_size,
                                          seed=0, shuffle=False, repeat=False)
    except UserError as err:
        if "validation" in str(err):
            log.warning("no validation split: %s", err)
            return None
        raise


# ================================================================================================ pretrain
def pretrain(config: ml_collections.ConfigDict, workdir: str, stop_after: Optional[int] = None,
             devices: Optional[list] = None) -> dict[str, Any]:
    """Train `config` in `workdir`, resuming from its latest good checkpoint. Returns the final metrics.

    `stop_after`: behave as if preempted after that many steps of this invocation (checkpoint, return).
    `devices`: the devices of the mesh (default: all; the launcher always uses all).
    """
    # --------------------------------------------------------------------------------------- setup
    devices = list(devices) if devices is not None else jax.devices()
    config_lib.validate(config, len(devices))
    config_lib.write_workdir_config(workdir, config, write=jax.process_index() == 0)  # refuses another run's
    mesh = sharding_lib.make_mesh(config, devices)
    tokenizer = data_lib.get_tokenizer(config, workdir)
    cfg, model = build_model(config)
    tx, schedule = make_optimizer(config.train)
    total_steps, batch_size = int(config.train.steps), int(config.train.batch_size)

    # --------------------------------------------------------------------------------------- state
    init_fn = init_state_fn(model, tx, config)
    rng = jax.random.PRNGKey(int(config.train.seed))
    abstract = jax.eval_shape(init_fn, rng)
    shardings = sharding_lib.logical_to_shardings(abstract, mesh)
    train_iter = data_lib.pretrain_iterator(config, tokenizer, split="train", global_batch_size=batch_size,
                                            seed=int(config.train.seed))
    checkpointer = ckpt_lib.Checkpointer(workdir, every=int(config.checkpoint.every), keep=int(config.checkpoint.keep),
                                         async_=bool(config.checkpoint.async_save))
    restored = checkpointer.restore(None, sharding_lib.abstract_with_shardings(abstract, shardings))
    if restored is None:
        state = jax.jit(lambda r: nn.meta.unbox(init_fn(r)), out_shardings=shardings)(rng)
    else:
        state, data_state = restored
        ckpt_lib.check_tokenizer(checkpointer.restore_meta(int(state["step"])), tokenizer.fingerprint,
                                 os.path.join(workdir, "tokenizer", "vocab.txt"))
        train_iter.set_state(data_state)
        print(f"resumed from step {int(state['step'])} of {workdir}", flush=True)
    start_step = int(state["step"])
    meta = ckpt_lib.make_meta(config, state["params"], tokenizer.fingerprint)

    # --------------------------------------------------------------------------------------- compile
    batch_sh = sharding_lib.batch_sharding(mesh)
    train_step = jax.jit(make_train_step(model, tx, schedule, int(config.train.grad_accum_steps),
                                         str(config.train.get("dropout_rng", "threefry2x32"))),
                         in_shardings=(shardings, batch_sh),
                         out_shardings=(shardings, sharding_lib.replicated(mesh)), donate_argnums=0)
    eval_step = jax.jit(make_eval_step(model), in_shardings=(shardings["params"], batch_sh))
    flops = step_flops(config)
    peak = metrics_lib.peak_tflops(float(config.metrics.peak_tflops))
    tokens_per_step = batch_size * int(config.model.max_len)

    # --------------------------------------------------------------------------------------- loop
    ckpt_lib.install_sigterm_handler()
    writer = metrics_lib.MetricsWriter(workdir)
    if restored is not None:  # rows logged after this checkpoint by the previous process describe redone steps
        writer.write(start_step, {"event": metrics_lib.RESUMED})
    progress = metrics_lib.Progress(total_steps, start_step)
    log_every, eval_every = max(int(config.train.log_every), 1), int(config.train.eval_every)
    pending: Optional[tuple[int, dict]] = None   # (step, device metrics) of the previous step, fetched one late
    window_start, window_steps = time.perf_counter(), 0
    last_metrics: dict[str, Any] = {}

    def fetch(step: int, device_metrics: dict) -> dict:
        values = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
        if not all(math.isfinite(v) for v in values.values()):
            bad = ", ".join(f"{k}={v}" for k, v in values.items() if not math.isfinite(v))
            checkpointer.wait()   # let an in-flight save of a good step commit before we stop
            diverged(step, bad)
        return values

    def diverged(step: int, what: str) -> None:
        kept = checkpointer.latest_step()
        raise UserError(f"training diverged at step {step} ({what})", f"{workdir}/checkpoints",
                        "lower --config.train.learning_rate or raise warmup; "
                        + (f"the last good checkpoint (step {kept}) is kept" if kept is not None
                           else "no checkpoint had been written yet"))

    all_finite = jax.jit(lambda tree: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x))
                                                         for x in jax.tree_util.tree_leaves(tree)])))

    def log_step(step: int, values: dict) -> None:
        nonlocal window_start, window_steps
        elapsed = time.perf_counter() - window_start
        step_time = elapsed / max(window_steps, 1)
        values = dict(values)
        if model.cfg.causal:
            values["perplexity"] = math.exp(min(values["loss"], 80.0))
        else:
            values["mlm_accuracy"] = values.pop("accuracy")
        values.update(step_time_s=step_time, tokens_per_sec=tokens_per_step / step_time,
                      model_tflops=flops / step_time / 1e12)
        if peak > 0:
            values["mfu"] = metrics_lib.mfu(flops, step_time, len(devices), peak)
        writer.write(step, values)
        progress.line(step, {k: values[k] for k in ("loss", "learning_rate") if k in values})
        last_metrics.update(values)
        window_start, window_steps = time.perf_counter(), 0

    step = start_step
    stopped_early = False
    while step < total_steps:
        batch = sharding_lib.global_batch(next(train_iter), mesh)
        state, device_metrics = train_step(state, batch)
        step += 1
        window_steps += 1
        if pending is not None:                      # the previous step is done by now (or nearly)
            values = fetch(*pending)
            if pending[0] % log_every == 0:
                log_step(pending[0], values)
        pending = (step, device_metrics)
        preempted = checkpointer.reached_preemption(step) or (stop_after is not None
                                                              and step - start_step >= stop_after)
        if step % int(config.checkpoint.every) == 0 or step == total_steps or preempted:
            values = fetch(*pending)                 # never checkpoint a diverged state
            if step % log_every == 0 or step == total_steps:
                log_step(step, values)
            pending = None
            if not bool(all_finite(state["params"])):   # finite loss, but the update overflowed the params
                checkpointer.wait()
                diverged(step, "non-finite parameters after the update")
            checkpointer.save(step, state, train_iter.get_state(), meta, force=True)
        if eval_every > 0 and step % eval_every == 0 and step < total_steps:
            write_eval(writer, step, eval_step, state["params"], config, tokenizer, mesh, model.cfg.causal)
        if preempted:
            print(f"preemption: saved step {step} to {checkpointer.directory}; exiting", flush=True)
            stopped_early = True
            break

    # --------------------------------------------------------------------------------------- finish
    if pending is not None:
        log_step(pending[0], fetch(*pending))
    checkpointer.wait()
    final: dict[str, Any] = {"step": step, **last_metrics}
    if not stopped_early and start_step < total_steps:
        final.update(write_eval(writer, step, eval_step, state["params"], config, tokenizer, mesh, model.cfg.causal))
    checkpointer.close()
    writer.close()
    return final


def write_eval(writer, step, eval_step, params, config, tokenizer, mesh, causal: bool) -> dict[str, float]:
    batches = validation_batches(config, tokenizer, int(config.train.batch_size))
    if batches is None:
        return {}
    sums = run_eval(eval_step, params, batches, mesh, int(config.train.eval_steps))
    values = summarize(sums, causal, prefix="eval_")
    writer.write(step, values)
    print(f"step {step} | " + " | ".join(f"{k} {v:.4f}" for k, v in values.items()), flush=True)
    return values


# ================================================================================================ restore for eval
@dataclasses.dataclass
class LoadedRun:
    config: ml_collections.ConfigDict
    model_cfg: ModelConfig
    params: Any
    tokenizer: Any
    step: int


def load_run(workdir: str, step: Optional[int] = None) -> LoadedRun:
    """A finished (or running) run's config, params (on the default device), tokenizer and step."""
    config = config_lib.load_workdir_config(workdir)
    cfg, model = build_model(config)
    checkpointer = ckpt_lib.Checkpointer(workdir, read_only=True)
    steps = checkpointer.all_steps() if os.path.isdir(checkpointer.directory) else []
    if not steps:
        checkpointer.close()
        raise UserError(f"no checkpoint in {workdir}/checkpoints", "--workdir", "pretrain this workdir first")
    if step is not None and step not in steps:
        checkpointer.close()
        raise UserError(f"no checkpoint at step {step} in {workdir}/checkpoints", "--step", f"use one of {steps}")
    step = steps[-1] if step is None else step
    meta = checkpointer.restore_meta(step)
    checkpointer.close()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.eval_shape(lambda: model.init({"params": jax.random.PRNGKey(0)},
                                                 jnp.zeros((1, 8), jnp.int32))["params"])
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                                      nn.meta.unbox(abstract))
    params = ckpt_lib.restore_params(workdir, step, abstract)
    tokenizer = data_lib.get_tokenizer(config, workdir)
    ckpt_lib.check_tokenizer(meta, tokenizer.fingerprint, os.path.join(workdir, "tokenizer", "vocab.txt"))
    return LoadedRun(config, cfg, params, tokenizer, step)


def evaluate(workdir: str, step: Optional[int] = None) -> dict[str, float]:
    """Restore `workdir` at `step` (default latest), evaluate on the whole validation split, log to metrics."""
    run = load_run(workdir, step)
    config = run.config
    with config.unlocked():
        config.mesh.data, config.mesh.fsdp, config.mesh.tensor = -1, 1, 1   # any device count can evaluate
    mesh = sharding_lib.make_mesh(config)
    model = TransformerLM(run.model_cfg)
    batch_size = int(config.train.batch_size)
    batch_size -= batch_size % jax.device_count() or 0
    batches = validation_batches(config, run.tokenizer, max(batch_size, jax.device_count()))
    if batches is None:
        raise UserError(f"the corpus of {workdir} has no validation split", "data.holdout",
                        "set --config.data.holdout>0 when pretraining")
    params = jax.device_put(run.params, sharding_lib.replicated(mesh))
    sums = run_eval(jax.jit(make_eval_step(model)), params, batches, mesh, 0)
    values = summarize(sums, run.model_cfg.causal, prefix="eval_")
    with metrics_lib.MetricsWriter(workdir) as writer:
        writer.write(run.step, {**values, "split": "validation", "evaluated_tokens": float(sums["weight"])})
    print(f"{workdir} step {run.step}: " + " | ".join(f"{k} {v:.4f}" for k, v in values.items()), flush=True)
    return values


# ================================================================================================ demo
def demo(workdir: str) -> dict[str, Any]:
    """The README's first command: pretrain a tiny TUPE-R MLM on the embedded corpus, checkpoint, evaluate."""
    from configs import pretrain as pretrain_config  # pylint: disable=import-outside-toplevel
    from tupe_jax import plots  # pylint: disable=import-outside-toplevel

    config = pretrain_config.get_config("pe=tupe_r,size=tiny,objective=mlm")
    config_lib.apply_overrides(config, {"train.steps": "500", "train.batch_size": "32", "train.warmup_steps": "50",
                                        "train.log_every": "25", "train.eval_every": "100",
                                        "checkpoint.every": "100"})
    config_lib.write_workdir_config(workdir, config)
    print(f"demo: tiny TUPE-R MLM ({config.model.num_layers} layers, d={config.model.hidden_size}) on the embedded "
          f"corpus (CPython's documentation text), {config.train.steps} steps, workdir {workdir}", flush=True)
    pretrain(config, workdir)
    values = evaluate(workdir)
    history = [m for m in metrics_lib.read_metrics(workdir) if "loss" in m and "split" not in m]
    evals = [m for m in metrics_lib.read_metrics(workdir) if "eval_loss" in m and "split" not in m]
    png = plots.loss_curve(history, os.path.join(workdir, "loss.png"), title="demo: TUPE-R MLM, embedded corpus",
                           eval_history=evals)
    first, last = history[0], history[-1]
    print(f"\nloss: step {first['step']} {first['loss']:.3f} -> step {last['step']} {last['loss']:.3f}; "
          f"validation loss {values['eval_loss']:.3f}, MLM accuracy {values['eval_mlm_accuracy']:.3f}")
    print(f"results: {workdir}/metrics.jsonl, {png}, checkpoints in {workdir}/checkpoints, "
          f"TensorBoard in {workdir}/tensorboard")
    return values
