"""The pretraining objective on one batch, the eval step, summaries and model FLOPs per step.

    batch_loss(model, params, batch, rng, deterministic) -> (Σ token NLL, {'weight', 'correct'})
    make_train_step(model, tx, schedule, grad_accum_steps, dropout_rng) -> the jittable train step
    make_eval_step(model) -> (params, batch) -> {'loss_sum', 'weight', 'correct'}
    run_eval(eval_step, params, batches, mesh, max_batches) -> summed statistics
    summarize(sums, causal, prefix) -> loss + MLM accuracy or perplexity
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import ml_collections
import optax

from tupe_jax import metrics as metrics_lib
from tupe_jax import sharding as sharding_lib
from tupe_jax import trainer as trainer_lib
from tupe_jax.data.batch import LMBatch
from tupe_jax.data.pipeline import resolve_max_predictions
from tupe_jax.model import TransformerLM


def batch_loss(model: TransformerLM, params: Any, batch: LMBatch, rng: jax.Array, deterministic: bool):
    """(Σ token NLL, {'weight': Σ weights, 'correct': Σ weighted hits}) for an MLM or CLM batch. MLM scores the
    gathered prediction slots (`mlm_positions`), CLM every next token (`head.tied_cross_entropy`)."""
    if model.cfg.causal:
        labels, weights, inputs = batch.targets, batch.weights, {}
    else:
        labels, weights = batch.mlm_labels, batch.mlm_weights
        inputs = {"input_mask": batch.input_mask, "mlm_positions": batch.mlm_positions}
    out = model.apply({"params": params}, batch.inputs, deterministic=deterministic, rngs={"dropout": rng},
                      labels=labels, label_weights=weights, **inputs)
    return out["nll_sum"], {"weight": jnp.sum(weights), "correct": out["correct"]}


def make_train_step(model: TransformerLM, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    grad_accum_steps: int = 1, dropout_rng: str = "threefry2x32") -> Callable:
    """The pretraining train step (`trainer.make_train_step` over `batch_loss`); metrics loss, grad_norm,
    learning_rate, accuracy (of the predicted tokens)."""
    return trainer_lib.make_train_step(lambda p, b, r: batch_loss(model, p, b, r, deterministic=False), tx, schedule,
                                       grad_accum_steps, dropout_rng, ratios={"accuracy": "correct"})


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


def make_eval_step(model: TransformerLM) -> Callable:
    def eval_step(params: Any, batch: LMBatch) -> dict:
        loss_sum, aux = batch_loss(model, params, batch, jax.random.PRNGKey(0), deterministic=True)
        return {"loss_sum": loss_sum, **aux}
    return eval_step


def run_eval(eval_step: Callable, params: Any, batches: Iterable[LMBatch], mesh, max_batches: int
             ) -> dict[str, float]:
    """Sum eval statistics over up to `max_batches` batches (all if <= 0)."""
    totals: dict[str, float] = {"loss_sum": 0.0, "weight": 0.0, "correct": 0.0}
    for i, batch in enumerate(batches):
        if 0 < max_batches <= i:
            break
        sums = jax.device_get(eval_step(params, sharding_lib.global_batch(batch, mesh)))
        for key in totals:
            totals[key] += float(sums[key])
    return totals


def step_flops(config: ml_collections.ConfigDict) -> float:
    """Model FLOPs of one training step (see metrics.transformer_training_flops)."""
    m = config.model
    causal = m.objective == "clm"
    return metrics_lib.transformer_training_flops(
        m.num_layers, m.hidden_size, m.mlp_dim, m.vocab_size, m.max_len, config.train.batch_size, causal=causal,
        mlm_predictions=None if causal else resolve_max_predictions(config, int(m.max_len)),
        last_layer_predictions=m.get("last_layer_rows", "all") == "predicted")
