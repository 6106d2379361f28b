"""GLUE fine-tuning (`python -m launch finetune`) and the paper's lr x seed sweep (`python -m launch glue-sweep`).

    finetune(config, workdir) -> dict   one task, one lr, one seed; resumable; writes results.json
    sweep(config, workdir) -> dict      tasks x sweep.learning_rates x sweep.seeds sub-runs (finished ones skipped),
                                        then sweep.json / sweep.md (median over seeds per lr; best lr; GLUE avg)

Protocol (TUPE App. B): batch 32, lr in {2,3,4,5}e-5, 10 epochs (5 for MNLI/QNLI/QQP), 6 % warmup then linear
decay, AdamW (b=(0.9, 0.999), eps 1e-6, wd 0.01, clip 1.0), dropout 0.1, 5 seeds, median of the best lr, dev sets.
A run's number is its best dev evaluation over epochs (fairseq's checkpoint_best, as the paper's code selects);
its test predictions come from that same evaluation.

Workdir: config.json, metrics.jsonl (train rows: step, epoch, loss, learning_rate; eval rows: eval_<metric>),
checkpoints/ (state + {'best': ...} as the data item; restarting resumes), results.json, predictions/<Task>.tsv.
"""
from __future__ import annotations

import itertools
import json
import logging
import math
import os
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from tupe_jax import checkpoint as ckpt_lib
from tupe_jax import config as config_lib
from tupe_jax import data as data_lib
from tupe_jax import finetune_lib as ft
from tupe_jax import glue_metrics as gm
from tupe_jax import metrics as metrics_lib
from tupe_jax import sharding as sh
from tupe_jax.data.tokenizer import Tokenizer
from tupe_jax.errors import UserError, require
from tupe_jax.model import ModelConfig, SequenceClassifier
from tupe_jax.optim import accumulate_gradients, dropout_key, make_optimizer

log = logging.getLogger(__name__)


# ================================================================================================ steps
def make_loss_fn(model: SequenceClassifier) -> Callable:
    """(params, batch, rng) -> (Σ weighted loss, Σ weight): cross-entropy, or squared error for regression."""
    def loss_fn(params: Any, batch: dict, rng: jax.Array):
        logits = model.apply({"params": params}, batch["inputs"], batch["input_mask"], deterministic=False,
                             rngs={"dropout": rng})
        w = batch["example_weight"]
        if model.num_labels == 1:
            per = jnp.square(logits[:, 0] - batch["label"].astype(jnp.float32))
        else:
            per = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        return jnp.sum(per * w), jnp.sum(w)
    return loss_fn


def make_train_step(model: SequenceClassifier, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    grad_accum_steps: int, dropout_rng: str = "threefry2x32") -> Callable:
    plain_loss_fn = make_loss_fn(model)
    loss_fn = lambda p, b, r: plain_loss_fn(p, b, dropout_key(r, dropout_rng))  # noqa: E731

    def train_step(state: dict, batch: dict) -> tuple[dict, dict]:
        rng = jax.random.fold_in(state["rng"], state["step"])
        loss, grads, _ = accumulate_gradients(loss_fn, state["params"], batch, grad_accum_steps, rng)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
                     "opt_state": opt_state, "rng": state["rng"]}
        return new_state, {"loss": loss, "learning_rate": schedule(state["step"])}
    return train_step


def make_eval_step(model: SequenceClassifier) -> Callable:
    def eval_step(params: Any, batch: dict) -> dict:
        logits = model.apply({"params": params}, batch["inputs"], batch["input_mask"], deterministic=True)
        return {"logits": logits, "label": batch["label"], "index": batch["example_index"]}
    return eval_step


def init_state_fn(model: SequenceClassifier, tx: optax.GradientTransformation, max_len: int) -> Callable:
    """rng -> boxed state {'step', 'params', 'opt_state', 'rng'} (the pretraining layout)."""
    dummy = jnp.zeros((1, min(max_len, 8)), jnp.int32)

    def init(rng: jax.Array) -> dict:
        init_rng, dropout_rng = jax.random.split(rng)
        params = model.init({"params": init_rng}, dummy)["params"]
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params), "rng": dropout_rng}
    return init


def _host(x: jax.Array) -> np.ndarray:
    """A replicated global array as NumPy (works when it spans several processes)."""
    return np.asarray(x.addressable_data(0))


# ================================================================================================ runner
class Runner:
    """Everything one fine-tuning run needs: tokenizer, mesh, model, jitted steps, and split evaluation."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, devices: list | None = None):
        self.config, self.workdir, self.task = config, workdir, str(config.task)
        self.source = ft.open_init_source(config) if config.init_from else None
        if self.source is not None:
            self.tokenizer = Tokenizer.from_file(ft.adopt_tokenizer(self.source.workdir, workdir))
        else:
            self.tokenizer = data_lib.get_tokenizer(config, workdir)
        require(self.tokenizer.vocab_size <= int(config.model.vocab_size),
                f"the tokenizer has {self.tokenizer.vocab_size} tokens but model.vocab_size is "
                f"{config.model.vocab_size}", "--config.model.vocab_size", "use the pretraining run's vocab_size")
        self.mesh = sh.make_mesh(config, devices)
        self.model = SequenceClassifier(ModelConfig.from_config(config.model), data_lib.num_labels(self.task))
        t = config.train
        self.batch_size, self.seed = int(t.batch_size), int(t.seed)
        self.steps_per_epoch = len(self.train_batches(0))
        require(self.steps_per_epoch > 0, f"{self.task} train has fewer examples than one batch of {self.batch_size}",
                "--config.train.batch_size", "use a smaller batch")
        self.total_steps = int(t.steps) or (int(t.epochs) or ft.paper_epochs(self.task)) * self.steps_per_epoch
        self.epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        self.tx, self.schedule = make_optimizer(ft.schedule_section(config, self.total_steps))
        self.init_fn = init_state_fn(self.model, self.tx, int(config.model.max_len))
        self.rng = jax.random.PRNGKey(self.seed)
        self.abstract = jax.eval_shape(self.init_fn, self.rng)
        self.shardings = sh.logical_to_shardings(self.abstract, self.mesh)
        batch_sh, rep = sh.batch_sharding(self.mesh), sh.replicated(self.mesh)
        self.train_step = jax.jit(make_train_step(self.model, self.tx, self.schedule, int(t.grad_accum_steps),
                                                  str(t.get("dropout_rng", "threefry2x32"))),
                                  in_shardings=(self.shardings, batch_sh), out_shardings=(self.shardings, rep),
                                  donate_argnums=0)
        self.eval_step = jax.jit(make_eval_step(self.model), in_shardings=(self.shardings["params"], batch_sh),
                                 out_shardings=rep)

    def train_batches(self, epoch: int):
        return data_lib.glue_batches(self.config, self.tokenizer, self.task, "train", batch_size=self.batch_size,
                                     seed=self.seed, epoch=epoch)

    def init_state(self) -> dict:
        """Fresh state; with init_from, the encoder params replaced by the pretraining checkpoint's."""
        state = jax.jit(lambda r: nn.meta.unbox(self.init_fn(r)), out_shardings=self.shardings)(self.rng)
        if self.source is not None:
            target = sh.abstract_with_shardings(self.abstract, self.shardings)["params"]["encoder"]
            state["params"]["encoder"] = ft.restore_encoder(self.source, target)
        return state

    def predict(self, params: Any, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(example positions, labels, outputs) of every example of `split`, each exactly once, in order."""
        batches = data_lib.glue_batches(self.config, self.tokenizer, self.task, split,
                                        batch_size=int(self.config.train.eval_batch_size), shuffle=False)
        return self.predict_batches(params, batches)

    def predict_batches(self, params: Any, batches) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        idx, labels, outs = [], [], []
        for batch in batches:
            out = self.eval_step(params, sh.global_batch(batch, self.mesh))
            keep = _host(out["index"]) >= 0
            idx.append(_host(out["index"])[keep])
            labels.append(_host(out["label"])[keep])
            outs.append(_host(out["logits"])[keep])
        order = np.argsort(np.concatenate(idx), kind="stable")
        return np.concatenate(idx)[order], np.concatenate(labels)[order], np.concatenate(outs)[order]

    def dev_splits(self) -> list[tuple[str, str]]:
        """[(split, metric-key suffix)]: MNLI has matched and mismatched dev sets."""
        if self.task == "mnli":
            return [("validation_matched", ""), ("validation_mismatched", "_mm")]
        return [("validation", "")]

    def evaluate(self, params: Any) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for split, suffix in self.dev_splits():
            _, labels, outputs = self.predict(params, split)
            values = gm.task_metrics(self.task, labels, outputs)
            metrics.update({k + suffix: v for k, v in values.items()})
        return metrics

    def write_test_predictions(self, params: Any) -> list[str]:
        """predictions/<Task>.tsv for each available test split (+ AX.tsv for MNLI when diagnostic/ exists)."""
        out_dir, written = os.path.join(self.workdir, "predictions"), []
        splits = [("test_matched", "mnli"), ("test_mismatched", "mnli_mm")] if self.task == "mnli" \
            else [("test", self.task)]
        for split, name in splits:
            try:
                examples = data_lib.glue_examples(self.config, self.task, split)
                positions, _, outputs = self.predict(params, split)
            except UserError as err:
                log.warning("no test predictions for %s %s: %s", self.task, split, err)
                continue
            if jax.process_index() == 0:
                written.append(gm.write_submission(out_dir, name, [examples[i]["idx"] for i in positions], outputs))
        if self.task == "mnli":
            written += self._write_ax(params, out_dir)
        return written

    def _write_ax(self, params: Any, out_dir: str) -> list[str]:
        path = os.path.join(os.path.expanduser(str(self.config.data.glue_dir or "")), "diagnostic", "diagnostic.tsv")
        if not self.config.data.glue_dir or not os.path.isfile(path):
            return []
        from tupe_jax.data import glue as glue_data  # pylint: disable=import-outside-toplevel
        with open(path, encoding="utf-8") as f:
            header, *rows = [line.rstrip("\r\n").split("\t") for line in f if line.strip()]
        col = {name: i for i, name in enumerate(header)}
        require(all(k in col for k in ("index", "sentence1", "sentence2")), f"{path} lacks index/sentence1/sentence2",
                str(path), "use the GLUE diagnostic.tsv")
        examples = [{"sentence1": r[col["sentence1"]], "sentence2": r[col["sentence2"]], "label": 0} for r in rows]
        enc = glue_data.encode_glue(self.tokenizer, examples, int(self.config.model.max_len), False)
        batches = glue_data.GlueBatches(enc, batch_size=int(self.config.train.eval_batch_size),
                                        max_len=int(self.config.model.max_len),
                                        buckets=tuple(self.config.data.glue_buckets), shuffle=False, seed=0, epoch=0,
                                        drop_remainder=False, process_index=jax.process_index(),
                                        process_count=jax.process_count())
        positions, _, outputs = self.predict_batches(params, batches)
        if jax.process_index() != 0:
            return []
        return [gm.write_submission(out_dir, "ax", [int(rows[i][col["index"]]) for i in positions], outputs)]

    def majority_baseline(self) -> dict[str, float]:
        """Accuracy of the train set's majority class on each dev split (not for STS-B)."""
        if self.task == "stsb":
            return {}
        train = [e["label"] for e in data_lib.glue_examples(self.config, self.task, "train")]
        top = int(np.bincount(np.asarray(train)).argmax())
        out = {}
        for split, suffix in self.dev_splits():
            dev = np.asarray([e["label"] for e in data_lib.glue_examples(self.config, self.task, split)])
            out["accuracy" + suffix] = float(np.mean(dev == top))
        return out


# ================================================================================================ finetune
def _write_json(path: str, obj: Any) -> None:
    if jax.process_index() != 0:
        return
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=float)
        f.write("\n")
    os.replace(tmp, path)


def finetune(config: ml_collections.ConfigDict, workdir: str, devices: list | None = None) -> dict[str, Any]:
    """Fine-tune `config.task` in `workdir` (resuming from its latest checkpoint); returns results.json's dict.

    `devices`: the devices of the mesh (default: all; the launcher always uses all).
    """
    devices = list(devices) if devices is not None else jax.devices()
    ft.validate_glue(config, len(devices))
    os.makedirs(workdir, exist_ok=True)
    runner = Runner(config, workdir, devices)
    task, total, spe = runner.task, runner.total_steps, runner.steps_per_epoch
    key = gm.headline_key(task)
    t = config.train

    checkpointer = ckpt_lib.Checkpointer(workdir, every=int(config.checkpoint.every), keep=int(config.checkpoint.keep),
                                         async_=bool(config.checkpoint.async_save))
    restored = checkpointer.restore(None, sh.abstract_with_shardings(runner.abstract, runner.shardings))
    if restored is None:
        state, progress = runner.init_state(), {"best": None, "last_eval": None, "predictions": []}
    else:
        state, progress = restored
        progress.setdefault("best", None)
        progress.setdefault("predictions", [])
        print(f"resumed {task} from step {int(state['step'])} of {workdir}", flush=True)
    meta = ckpt_lib.make_meta(config, state["params"])
    step = int(state["step"])
    origin = (f"{runner.source.workdir} step {runner.source.step}" if runner.source else "scratch (no init_from)")
    if step == 0:
        print(f"fine-tuning {task} from {origin}: {total} steps = {runner.epochs} epochs x {spe} steps, "
              f"batch {runner.batch_size}, lr {float(t.learning_rate):g}, seed {runner.seed}", flush=True)

    ckpt_lib.install_sigterm_handler()
    writer = metrics_lib.MetricsWriter(workdir)
    bar = metrics_lib.Progress(total, step)
    log_every, eval_every = max(int(t.log_every), 1), int(t.eval_every)

    def run_eval(at_step: int) -> None:
        metrics = runner.evaluate(state["params"])
        epoch = at_step / spe
        writer.write(at_step, {"epoch": epoch, **{f"eval_{k}": v for k, v in metrics.items()}})
        print(f"eval {task} step {at_step} epoch {epoch:.2f} | "
              + " | ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
        progress["last_eval"] = {"step": at_step, "epoch": epoch, "metrics": metrics}
        best = progress["best"]
        if best is None or metrics[key] > best["metrics"][key]:
            progress["best"] = {"step": at_step, "epoch": epoch, "metrics": metrics}
            if bool(t.predict_test):
                progress["predictions"] = runner.write_test_predictions(state["params"])

    preempted = False
    while step < total and not preempted:
        epoch = step // spe
        batches = itertools.islice(iter(runner.train_batches(epoch)), step - epoch * spe, None)
        for batch in batches:
            state, device_metrics = runner.train_step(state, sh.global_batch(batch, runner.mesh))
            step += 1
            if step % log_every == 0 or step == total:
                values = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
                if not all(math.isfinite(v) for v in values.values()):
                    raise UserError(f"fine-tuning diverged at step {step} (loss {values['loss']})", "--workdir",
                                    "lower --config.train.learning_rate")
                writer.write(step, {"epoch": step / spe, **values})
                bar.line(step, {"epoch": step / spe, **values})
            epoch_end = step % spe == 0 or step == total
            if epoch_end or (eval_every > 0 and step % eval_every == 0):
                run_eval(step)
            preempted = checkpointer.reached_preemption(step)
            if epoch_end or preempted or step % int(config.checkpoint.every) == 0:
                checkpointer.save(step, state, progress, meta, force=True)
            if step >= total or preempted:
                break
    checkpointer.close()
    writer.close()
    if preempted:
        print(f"preemption: saved step {step} to {checkpointer.directory}; exiting", flush=True)
        return {"preempted": True, "step": step}

    best, last = progress["best"], progress["last_eval"]
    results = {
        "task": task, "headline_key": key, "score": best["metrics"][key] if best else None,
        "best": best, "final": last, "steps": total, "epochs": runner.epochs, "steps_per_epoch": spe,
        "batch_size": runner.batch_size, "learning_rate": float(t.learning_rate), "seed": runner.seed,
        "init_from": runner.source.workdir if runner.source else "", "init_step": runner.source.step if runner.source
        else None, "majority_baseline": runner.majority_baseline(), "predictions": progress.get("predictions", []),
    }
    _write_json(os.path.join(workdir, "results.json"), results)
    return results


# ================================================================================================ sweep
def run_dir(workdir: str, task: str, lr: float, seed: int) -> str:
    return os.path.join(workdir, task, f"lr={float(lr):g}", f"seed={int(seed)}")


def sub_config(config: ml_collections.ConfigDict, task: str, lr: float, seed: int) -> ml_collections.ConfigDict:
    """The sweep's config for one (task, lr, seed) run."""
    sub = ml_collections.ConfigDict(config.to_dict())
    sub.task, sub.sweep.tasks = task, task
    sub.train.learning_rate, sub.train.seed = float(lr), int(seed)
    sub.train.epochs = int(config.train.epochs) or ft.paper_epochs(task)
    return config_lib.lock(sub)


def sweep(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Run every (task, lr, seed) not finished yet, then write sweep.json and sweep.md; returns sweep.json's dict."""
    ft.validate_glue(config, jax.device_count())
    tasks = ft.sweep_tasks(config)
    lrs = [float(x) for x in config.sweep.learning_rates]
    seeds = [int(s) for s in config.sweep.seeds]
    grid = [(t, lr, s) for t in tasks for lr in lrs for s in seeds]
    for i, (task, lr, seed) in enumerate(grid, 1):
        path = run_dir(workdir, task, lr, seed)
        if os.path.isfile(os.path.join(path, "results.json")):
            print(f"[{i}/{len(grid)}] {task} lr={lr:g} seed={seed}: done, skipping", flush=True)
            continue
        print(f"[{i}/{len(grid)}] {task} lr={lr:g} seed={seed} -> {path}", flush=True)
        sub = sub_config(config, task, lr, seed)
        config_lib.write_workdir_config(path, sub, write=jax.process_index() == 0)
        out = finetune(sub, path)
        if out.get("preempted"):
            print("sweep stopped by preemption; rerun the same command to continue", flush=True)
            return {"preempted": True}
    summary = gm.summarize_sweep(workdir, tasks, lrs, seeds, run_dir)
    _write_json(os.path.join(workdir, "sweep.json"), summary)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "sweep.md"), "w", encoding="utf-8") as f:
            f.write(gm.sweep_markdown(summary))
        print(gm.sweep_markdown(summary), flush=True)
    return summary
