"""One trainer for every loop (pretraining and fine-tuning): the train step over any loss, sharded state init,
restore-or-init, the finiteness rule, preemption, and metrics fetched one step late.

    step_fn = make_train_step(loss_fn, tx, schedule, grad_accum_steps, dropout_rng, ratios)
    trainer = Trainer(init_fn, seed, mesh, step_fn, checkpointer)
    state, payload = trainer.restore_or_init(fresh=...)        # payload: the checkpoint's `data` item, or None
    outcome = trainer.fit(state, batches, total_steps, hooks)  # Hooks: what each loop adds (logging, eval, ...)

The state is a dict {'step', 'params', 'opt_state', 'rng'} (the checkpoint layout). `rng` is a raw threefry key;
step s draws dropout from fold_in(rng, s) (microbatch i of it from a further fold_in(·, i)), so a resumed run
draws exactly the masks of an uninterrupted one.

The finiteness rule (one for every loop): every step's metrics are checked when they are fetched (one step
late); at each checkpoint the step's own metrics and the parameters are checked before anything is saved, so a
diverged state is never checkpointed. A failure raises `UserError` naming the step and the last good checkpoint.
Before every checkpoint the folder must still be this run's (`workdir.still_held`: a bucket lease that another
command took over stops every process, with one line, before anything is written).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import threading
import time
from typing import Any, Callable, Iterable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from tupe_jax import checkpoint as ckpt_lib
from tupe_jax import files, local_staging
from tupe_jax import sharding as sharding_lib
from tupe_jax import workdir as workdir_lib
from tupe_jax import xla_options
from tupe_jax.errors import Diverged, UserError
from tupe_jax.optim import accumulate_gradients, dropout_key

# loss_fn(params, batch, dropout_rng) -> (Σ per-example loss, {'weight': Σ weights, other sums...})
LossFn = Callable[[Any, Any, jax.Array], tuple[jax.Array, dict]]


def parse_profile_steps(text: str, key: str = "train.profile_steps") -> Optional[tuple[int, int]]:
    """"START,END" -> (START, END), 1 <= START <= END; "" -> None. UserError otherwise."""
    if not str(text).strip():
        return None
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != 2 or not all(p.isdecimal() for p in parts) or not 1 <= int(parts[0]) <= int(parts[1]):
        raise UserError(f"{key} = {text!r} is not START,END with 1 <= START <= END", f"--config.{key}",
                        "write e.g. --config.train.profile_steps=10,15 (or leave it empty)")
    return int(parts[0]), int(parts[1])


def init_state_fn(model: nn.Module, tx: optax.GradientTransformation, max_len: int) -> Callable:
    """rng -> boxed train state {'step', 'params', 'opt_state', 'rng'} (for eval_shape and the sharded init)."""
    dummy = jnp.zeros((1, min(int(max_len), 8)), jnp.int32)

    def init(rng: jax.Array) -> dict:
        init_rng, dropout_rng = jax.random.split(rng)
        params = model.init({"params": init_rng}, dummy)["params"]
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params), "rng": dropout_rng}
    return init


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    grad_accum_steps: int, dropout_rng: str = "threefry2x32",
                    ratios: Optional[dict[str, str]] = None) -> Callable:
    """(state, batch) -> (state, metrics): gradient accumulation over `grad_accum_steps` microbatches, one optimizer
    update. Metrics: loss (Σ loss / Σ weight), grad_norm, learning_rate, and for each `ratios` entry
    {name: aux key} the ratio Σ aux[key] / Σ weight (e.g. {'accuracy': 'correct'})."""
    ratios = dict(ratios or {})

    def train_step(state: dict, batch: Any) -> tuple[dict, dict]:
        rng = jax.random.fold_in(state["rng"], state["step"])
        keyed = lambda p, b, r: loss_fn(p, b, dropout_key(r, dropout_rng))  # noqa: E731
        loss, grads, aux = accumulate_gradients(keyed, state["params"], batch, grad_accum_steps, rng)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
                     "opt_state": opt_state, "rng": state["rng"]}
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "learning_rate": schedule(state["step"])}
        for name, key in ratios.items():
            metrics[name] = aux[key] / jnp.maximum(aux["weight"], 1e-9)
        return new_state, metrics
    return train_step


@dataclasses.dataclass
class Hooks:
    """What a loop adds to `Trainer.fit`. Every hook is optional.

    log(step, values)         a fetched step's metrics (+ step_time_s) at a logging step (`log_every`) or a sync point
    after_step(step, state)   after each step, before its checkpoint (evaluation, best-so-far bookkeeping)
    payload()                 the checkpoint's `data` item (the data-iterator state, or the loop's progress)
    checkpoint_due(step)      an extra checkpoint condition (default: every `checkpointer.every` steps)
    sync_due(step)            also fetch the step's metrics at once at this step (e.g. before an evaluation)
    """
    log: Optional[Callable[[int, dict], None]] = None
    after_step: Optional[Callable[[int, dict], None]] = None
    payload: Optional[Callable[[], dict]] = None
    checkpoint_due: Optional[Callable[[int], bool]] = None
    sync_due: Optional[Callable[[int], bool]] = None


@dataclasses.dataclass
class Outcome:
    state: dict
    step: int
    preempted: bool


@contextlib.contextmanager
def ctrl_c_saves():
    """While a one-process run trains: the first Ctrl-C (SIGINT) sets `flag['set']`, and the loop checkpoints that
    step and stops, as on preemption; a second raises KeyboardInterrupt at once, unless that save has begun
    (`flag['saving']`: it commits first). Python's own handler raises wherever
    the main thread is, and inside a callback (JAX's garbage-collection hook) the interrupt is printed and dropped:
    the run went on. Several processes keep Python's handler (a save is collective; one host's Ctrl-C is not the
    others'), and so does a process that ignores SIGINT (a background job)."""
    flag = {"set": False}
    previous = signal.getsignal(signal.SIGINT)
    if (jax.process_count() > 1 or threading.current_thread() is not threading.main_thread()
            or previous is signal.SIG_IGN):
        yield flag
        return

    def handler(signum: int, frame: Any) -> None:  # pylint: disable=unused-argument
        if flag.get("saving"):   # stopping it now would leave an unfinished step folder and Orbax's tracebacks
            print("interrupt: the save of this step is being committed; it stops in a moment", flush=True)
            return
        if flag["set"]:
            raise KeyboardInterrupt
        flag["set"] = True
        print("interrupt: saving this step (unless it is this process's first), then stopping (Ctrl-C again "
              "to stop at once)", flush=True)
    signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


@dataclasses.dataclass(frozen=True)
class Profile:
    """A jax.profiler trace of steps `first`..`last`, written to `folder`. With `target` (a bucket path), `folder` is
    a local staging folder whose files are uploaded there after the trace and then removed: jaxlib's own GCS client
    would bypass the storage layer (`files`: gcsfs, its credentials and endpoint) that every other write uses."""
    first: int
    last: int
    folder: str
    target: Optional[str] = None

    def finish(self) -> str:
        """After `stop_trace`: upload a staged trace; returns where the trace is."""
        if self.target is None:
            return self.folder
        files.upload_tree(self.folder, self.target)
        local_staging.remove(self.folder)
        return self.target


class Trainer:
    """A sharded, jitted train step with its state: init or restore, then `fit` over batches."""

    def __init__(self, init_fn: Callable, seed: int, mesh: jax.sharding.Mesh, step_fn: Callable,
                 checkpointer: Optional[ckpt_lib.Checkpointer] = None, meta: Optional[Callable[[dict], dict]] = None,
                 log_every: int = 1, profile: Optional[Profile] = None):
        self.profile = profile
        self.mesh, self.checkpointer, self.log_every = mesh, checkpointer, max(int(log_every), 1)
        if checkpointer is not None:   # from here on SIGTERM means "save and stop" (also during restore/compile)
            ckpt_lib.install_sigterm_handler()
        self.init_fn, self.rng = init_fn, jax.random.PRNGKey(int(seed))
        self.abstract = jax.eval_shape(init_fn, self.rng)
        self.shardings = sharding_lib.logical_to_shardings(self.abstract, mesh)
        self.meta_fn = meta or (lambda state: {})
        self.step_fn = xla_options.jit(sharding_lib.with_activation_layout(step_fn, mesh),
                                       in_shardings=(self.shardings, sharding_lib.batch_sharding(mesh)),
                                       out_shardings=(self.shardings, sharding_lib.replicated(mesh)), donate_argnums=0)
        self._all_finite = jax.jit(lambda tree: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x))
                                                                   for x in jax.tree_util.tree_leaves(tree)])))

    @property
    def abstract_params(self) -> Any:
        """Unboxed ShapeDtypeStructs of the params, carrying their shardings (targets for partial restores)."""
        return sharding_lib.abstract_with_shardings(self.abstract, self.shardings)["params"]

    def restore_or_init(self, fresh: Optional[Callable[[dict], dict]] = None) -> tuple[dict, Optional[dict]]:
        """(state, payload): the newest good checkpoint (payload = its `data` item), or a fresh sharded state
        (passed through `fresh`, e.g. to load pretrained encoder weights) and None. Without a checkpointer: always
        fresh."""
        restored = None if self.checkpointer is None else self.checkpointer.restore(
            None, sharding_lib.abstract_with_shardings(self.abstract, self.shardings))
        if restored is not None:
            return restored
        state = jax.jit(lambda r: nn.meta.unbox(self.init_fn(r)), out_shardings=self.shardings)(self.rng)
        return (fresh(state) if fresh is not None else state), None

    def _diverged(self, step: int, what: str) -> None:
        self.checkpointer.wait()   # let an in-flight save of a good step commit before we stop
        kept = self.checkpointer.latest_step()
        raise Diverged(f"training diverged at step {step} ({what})", self.checkpointer.directory,
                        "lower --config.train.learning_rate or raise warmup; "
                        + (f"the last good checkpoint (step {kept}) is kept" if kept is not None
                           else "no checkpoint had been written yet"))

    def _fetch(self, step: int, device_metrics: dict) -> dict:
        values = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
        bad = ", ".join(f"{k}={v}" for k, v in values.items() if not math.isfinite(v))
        if bad:
            self._diverged(step, bad)
        return values

    def fit(self, state: dict, batches: Iterable[Any], total_steps: int, hooks: Optional[Hooks] = None,
            stop_after: Optional[int] = None) -> Outcome:
        """Train from `state` until `total_steps` (or the batches run out, or preemption); checkpoint at the due
        steps, at the end and on preemption. `stop_after`: behave as if preempted after that many steps. Ctrl-C
        (`ctrl_c_saves`): the step is checkpointed as on preemption, then KeyboardInterrupt goes on up."""
        if self.checkpointer is None:
            raise ValueError("Trainer.fit needs a checkpointer")
        with ctrl_c_saves() as interrupt:
            try:
                outcome = self._fit(state, batches, total_steps, hooks or Hooks(), stop_after, interrupt)
            except KeyboardInterrupt:   # a second Ctrl-C: a save in flight still commits (a third stops that)
                self.checkpointer.wait()
                raise
        if interrupt["set"] and outcome.step < total_steps:   # at the last step the run is complete anyway
            raise KeyboardInterrupt
        return outcome

    def _fit(self, state: dict, batches: Iterable[Any], total_steps: int, hooks: Hooks, stop_after: Optional[int],
             interrupt: dict) -> Outcome:
        start = step = int(state["step"])
        every = self.checkpointer.every
        meta = self.meta_fn(state)
        pending: Optional[tuple[int, dict]] = None      # the previous step's device metrics, fetched one late
        window = {"start": time.perf_counter(), "steps": 0}

        def log(at: int, values: dict) -> None:
            elapsed = time.perf_counter() - window["start"]
            values = {**values, "step_time_s": elapsed / max(window["steps"], 1)}
            window["start"], window["steps"] = time.perf_counter(), 0
            if hooks.log is not None:
                hooks.log(at, values)

        preempted = ckpt_lib.stop_requested() and stop_after is None and step < total_steps
        if preempted:   # SIGTERM during the setup (the launcher's handler) or the restore: not even a compile
            print(f"preemption before this process's first step: nothing saved; a rerun starts from "
                  f"{f'step {start}' if start else 'the beginning'}; exiting", flush=True)
            return Outcome(state, step, True)
        traced: Optional[int] = None         # the first step of a trace in progress
        iterator = iter(batches)
        while step < total_steps:
            batch = next(iterator, None)
            if batch is None:
                break
            if self.profile and traced is None and self.profile.first <= step + 1 <= self.profile.last:
                jax.profiler.start_trace(self.profile.folder)       # a resume inside the range traces the rest
                traced = step + 1
            with jax.profiler.StepTraceAnnotation("train", step_num=step + 1):
                state, device_metrics = self.step_fn(state, sharding_lib.global_batch(batch, self.mesh))
            step += 1
            if traced is not None and step == self.profile.last:
                self._stop_profile(traced, step, device_metrics)
                traced = None
            window["steps"] += 1
            if pending is not None:                      # the previous step is done by now (or nearly)
                values = self._fetch(*pending)
                if pending[0] % self.log_every == 0:
                    log(pending[0], values)
            pending = (step, device_metrics)
            preempted = interrupt["set"] or self.checkpointer.reached_preemption(step) or (
                stop_after is not None and step - start >= stop_after)
            if preempted and step == start + 1 and step < total_steps and stop_after is None:
                # The signal came while the first step compiled (minutes for a big model, which no signal cuts
                # short): a save of step start+1 would spend the notice's seconds to spare a rerun one step.
                why = "interrupted" if interrupt["set"] else "preemption"
                print(f"{why} during this process's first step: nothing saved; a rerun starts from "
                      f"{f'step {start}' if start else 'the beginning'}; exiting", flush=True)
                break
            save = (step % every == 0 or step == total_steps or preempted
                    or (hooks.checkpoint_due is not None and hooks.checkpoint_due(step)))
            if save or (hooks.sync_due is not None and hooks.sync_due(step)):
                values = self._fetch(*pending)           # never checkpoint (or evaluate) a diverged state
                if step % self.log_every == 0 or step == total_steps:
                    log(step, values)
                pending = None
            paused = time.perf_counter()       # evaluation and saving are no step's time (step_time_s, tokens/s)
            if hooks.after_step is not None:
                hooks.after_step(step, state)
            if save:
                if not bool(self._all_finite(state["params"])):   # finite loss, but the update overflowed
                    self._diverged(step, "non-finite parameters after the update")
                workdir_lib.still_held(self.checkpointer.workdir)   # a bucket lease taken over: stop, write nothing
                interrupt["saving"] = preempted
                self.checkpointer.save(step, state, hooks.payload() if hooks.payload else {}, meta, force=True)
            window["start"] += time.perf_counter() - paused
            if preempted:
                why = "interrupted" if interrupt["set"] else "preemption"
                self.checkpointer.wait()             # "saved" once it is committed, not while it is in flight
                print(f"{why}: saved step {step} to {self.checkpointer.directory}; exiting", flush=True)
                break
        if traced is not None:                 # stopped (preempted) inside the range: keep what was traced
            self._stop_profile(traced, step, state["step"])
        if pending is not None:
            log(pending[0], self._fetch(*pending))
        self.checkpointer.wait()
        return Outcome(state, step, preempted)

    def _stop_profile(self, first: int, step: int, ready: Any) -> None:
        """End the trace begun at step `first` once `ready` is computed; say where it went."""
        jax.block_until_ready(ready)
        jax.profiler.stop_trace()
        where = self.profile.finish()
        print(f"profile: steps {first}-{step} traced to {where}", flush=True)
