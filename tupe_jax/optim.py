"""Optimizer: AdamW (no decay on biases / LayerNorm), linear warmup + linear decay to 0, global-norm clipping,
and gradient accumulation inside the train step.

Accumulation is done by `accumulate_gradients` inside the jitted step, not with `optax.MultiSteps`: the loss
function returns a SUM over tokens and a token count, the microbatch sums are added up and divided once by the total
count. So the loss and gradients equal those of the whole batch in one go even when microbatches hold different
numbers of masked tokens (MultiSteps would average per-microbatch means), and one optimizer update = one step of the
learning-rate schedule.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from tupe_jax.errors import UserError, require

# PRNG implementations for dropout masks (`train.dropout_rng`, see `dropout_key`).
DROPOUT_RNGS = ("threefry2x32", "rbg", "unsafe_rbg")


def validate_config(train: Any) -> None:
    """Check the optimizer keys of a `config.train` section (both loops' layout) before any compute."""
    for key in ("learning_rate", "adam_eps"):
        require(train[key] > 0, f"train.{key} = {train[key]} must be positive", f"--config.train.{key}",
                "give a positive value")
    for key in ("weight_decay", "clip_norm"):
        require(train[key] >= 0, f"train.{key} = {train[key]} must be >= 0", f"--config.train.{key}", "give 0 or more")
    for key in ("adam_b1", "adam_b2"):
        require(0.0 <= train[key] < 1.0, f"train.{key} = {train[key]} is outside [0, 1)", f"--config.train.{key}",
                "use e.g. 0.9 / 0.999")
    if "dropout_rng" in train:
        require(train.dropout_rng in DROPOUT_RNGS, f"unknown train.dropout_rng {train.dropout_rng!r}",
                "--config.train.dropout_rng", "use one of " + "|".join(DROPOUT_RNGS))


def schedule_span(steps: int, decay_steps: int, warmup_steps: int) -> tuple[int, int]:
    """(the step where the linear decay reaches 0, the warmup steps) of `learning_rate_fn`: `decay_steps`, 0 meaning
    `steps`; the warmup cut to that span (short smoke runs). What a resume must keep (workdir/gate.py)."""
    total = int(decay_steps or steps)
    return total, min(int(warmup_steps), total)


def learning_rate_fn(train: Any) -> optax.Schedule:
    """Linear warmup 0 → `train.learning_rate` over `warmup_steps`, then linear to 0 at `decay_steps`
    (0 means `train.steps`); 0 afterwards (`schedule_span`)."""
    peak = float(train.learning_rate)
    total, warmup = schedule_span(train.steps, train.decay_steps, train.warmup_steps)
    decay = optax.linear_schedule(peak, 0.0, max(total - warmup, 1))
    if warmup:
        decay = optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])
    # Under jit XLA's 1 - count/span rounds to about -1e-11 x peak at and after the end: 0 there, as documented.
    return lambda count: jnp.maximum(decay(count), 0.0)


def _key_name(entry: Any) -> str | None:
    if isinstance(entry, jax.tree_util.DictKey):
        return str(entry.key)
    if isinstance(entry, jax.tree_util.GetAttrKey):
        return None if entry.name == "value" else entry.name  # the `.value` of a Linen box
    return None


def decays(path: tuple[Any, ...]) -> bool:
    """Whether the param at `path` gets weight decay.

    No decay for leaves named `scale` or containing `bias` (biases, the MLM `head_bias`, T5's `rel_bias` table, as
    in the usual BERT recipe's name match) or anything under a module whose name contains `norm` or starts `ln`.
    """
    names = [n for n in (_key_name(e) for e in path) if n is not None]
    if not names:
        return True
    if names[-1] == "scale" or "bias" in names[-1]:
        return False
    return not any("norm" in n.lower() or n.lower().startswith("ln") for n in names[:-1])


def decay_mask(params: Any) -> Any:
    """A tree of bools matching `params` (boxed or not): True where weight decay applies."""
    return jax.tree_util.tree_map_with_path(lambda p, _: decays(p), params)


def make_optimizer(train: Any) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(optax transformation, learning-rate schedule) from the `train` config section."""
    schedule = learning_rate_fn(train)
    parts = []
    if float(train.clip_norm) > 0:
        parts.append(optax.clip_by_global_norm(float(train.clip_norm)))
    parts.append(optax.adamw(schedule, b1=float(train.adam_b1), b2=float(train.adam_b2), eps=float(train.adam_eps),
                             weight_decay=float(train.weight_decay), mask=decay_mask))
    return optax.chain(*parts), schedule


LossFn = Callable[[Any, Any, jax.Array], tuple[jax.Array, jax.Array]]


def split_microbatches(batch: Any, num_micro: int) -> Any:
    """(B, ...) leaves → (num_micro, B/num_micro, ...); microbatch i holds rows i, i+k, ... so each device keeps
    its own rows (no resharding of a batch sharded on its leading dimension)."""
    def split(x: jax.Array) -> jax.Array:
        x = x.reshape((x.shape[0] // num_micro, num_micro) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1)
    return jax.tree_util.tree_map(split, batch)


def accumulate_gradients(loss_fn: LossFn, params: Any, batch: Any, num_micro: int,
                         rng: jax.Array) -> tuple[jax.Array, Any, Any]:
    """Mean loss, mean grads and summed aux over `num_micro` microbatches.

    `loss_fn(params, microbatch, rng) -> (loss_sum, aux)` returns the SUM of per-token losses and either the number
    of tokens (or any weight) or a dict of sums holding it under 'weight' (e.g. also a count of correct
    predictions). Result = (Σ loss_sum / Σ weight, Σ grad(loss_sum) / Σ weight, Σ aux): identical to one pass over
    the whole batch up to float summation order. Microbatch i draws dropout from `fold_in(rng, i)`.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if num_micro == 1:
        (loss_sum, aux), grads = grad_fn(params, batch, rng)
    else:
        micro = split_microbatches(batch, num_micro)

        def body(carry: tuple[Any, jax.Array, Any], xs: tuple[Any, jax.Array]) -> tuple[Any, None]:
            acc_grads, acc_loss, acc_aux = carry
            mb, i = xs
            (l_sum, a), g = grad_fn(params, mb, jax.random.fold_in(rng, i))
            add = lambda x, y: jax.tree_util.tree_map(jnp.add, x, y)  # noqa: E731
            return (add(acc_grads, g), acc_loss + l_sum, add(acc_aux, a)), None

        aux_shape = jax.eval_shape(lambda: grad_fn(params, jax.tree_util.tree_map(lambda x: x[0], micro), rng)[0][1])
        init = (jax.tree_util.tree_map(jnp.zeros_like, params), jnp.zeros((), jnp.float32),
                jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape))
        (grads, loss_sum, aux), _ = jax.lax.scan(body, init, (micro, jnp.arange(num_micro)))
    weight = aux["weight"] if isinstance(aux, dict) else aux
    denom = jnp.maximum(weight, 1e-9).astype(jnp.float32)
    grads = jax.tree_util.tree_map(lambda g: (g / denom).astype(g.dtype), grads)
    return loss_sum / denom, grads, aux


def dropout_key(rng: jax.Array, impl: str) -> jax.Array:
    """The step's raw threefry key -> the key dropout draws from, in the PRNG implementation `impl`.

    The train state keeps a raw threefry key whatever `impl` is (checkpoints do not depend on it); 'rbg' and
    'unsafe_rbg' re-key from 4 threefry words. They draw the masks with XLA's RngBitGenerator instead of threefry
    hashing: BERT-base step on an H200 −4 %, +5 % on the CPU reference step (benchmarks/RESULTS.md). Different
    bits, so a run's dropout masks (not its statistics) depend on the choice.
    """
    if impl == "threefry2x32":
        return rng
    if impl not in DROPOUT_RNGS:
        raise UserError(f"unknown train.dropout_rng {impl!r}", "--config.train.dropout_rng",
                        "use one of " + "|".join(DROPOUT_RNGS))
    return jax.random.wrap_key_data(jax.random.bits(rng, (4,), jnp.uint32), impl=impl)
