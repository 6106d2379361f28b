"""One fine-tuning run's machinery: tokenizer, mesh, classifier, loss, batches, and dev/test evaluation.

`Runner(config, workdir)` resolves `init_from` (adopting the pretraining run's tokenizer), builds the
`SequenceClassifier`, counts steps (epochs x steps per epoch unless `train.steps`), and makes the train step for
`trainer.Trainer`. A run's number is its best dev evaluation over epochs; its test predictions (GLUE submission
format) come from that same evaluation.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from tupe_jax import data as data_lib
from tupe_jax import files
from tupe_jax import sharding as sh
from tupe_jax import trainer as trainer_lib
from tupe_jax import xla_options
from tupe_jax.data import classification
from tupe_jax.data.batch import ClassificationBatch
from tupe_jax.data import glue_tsv
from tupe_jax.data.builders import glue_fingerprint, local_glue_dir
from tupe_jax.data.tokenizer import Tokenizer
from tupe_jax.errors import UserError, require
from tupe_jax.finetune import scores
from tupe_jax.finetune.init_from import adopt_tokenizer, open_init_source, restore_encoder
from tupe_jax.finetune.validate import paper_epochs, schedule_section
from tupe_jax.model import ModelConfig, SequenceClassifier
from tupe_jax.optim import make_optimizer
from tupe_jax.workdir import checkpoint_steps

log = logging.getLogger(__name__)


def make_loss_fn(model: SequenceClassifier) -> Callable:
    """(params, batch, rng) -> (Σ weighted loss, {'weight': Σ weight}): cross-entropy, or squared error for
    regression (`num_labels == 1`)."""
    def loss_fn(params: Any, batch: ClassificationBatch, rng: jax.Array):
        logits = model.apply({"params": params}, batch.inputs, batch.input_mask, deterministic=False,
                             segments=batch.segments, rngs={"dropout": rng})
        w = batch.example_weight
        if model.num_labels == 1:
            per = jnp.square(logits[:, 0] - batch.label.astype(jnp.float32))
        else:
            per = optax.softmax_cross_entropy_with_integer_labels(logits, batch.label)
        return jnp.sum(per * w), {"weight": jnp.sum(w)}
    return loss_fn


def make_eval_step(model: SequenceClassifier) -> Callable:
    def eval_step(params: Any, batch: ClassificationBatch) -> dict:
        logits = model.apply({"params": params}, batch.inputs, batch.input_mask, deterministic=True,
                             segments=batch.segments)
        return {"logits": logits, "label": batch.label, "index": batch.example_index}
    return eval_step


def _host(x: jax.Array) -> np.ndarray:
    """A replicated global array as NumPy (works when it spans several processes)."""
    return np.asarray(x.addressable_data(0))


def on_every_process(ok: bool) -> bool:
    """`ok` on every process (a collective call with several: a host whose copy of the GLUE folder lacks a file
    must not leave the others waiting in a prediction it skips)."""
    return all(sh.gathered(int(bool(ok))))


def dev_splits(task: str) -> list[tuple[str, str]]:
    """[(split, metric-key suffix)]: MNLI has matched and mismatched dev sets."""
    return [("validation_matched", ""), ("validation_mismatched", "_mm")] if task == "mnli" else [("validation", "")]


def check_examples(config: ml_collections.ConfigDict, task: str, train: bool = True) -> None:
    """The task's train (`train`) and dev files read (every row parsed: a bad label, id or column count is refused
    naming its line) and each dev split has examples; a sweep checks every task so before its first sub-run trains."""
    if train:
        data_lib.glue_examples(config, task, "train")
    for split, _ in dev_splits(task):
        require(len(data_lib.glue_examples(config, task, split)) > 0, f"the {task} {split} split has no examples",
                f"data.glue_dir={config.data.glue_dir}", "give the task's dev file with at least one row")


def read_diagnostic(config: ml_collections.ConfigDict) -> list[dict] | None:
    """MNLI's diagnostic set (AX) in data.glue_dir, read and checked before training (a bad row found after it
    would cost the run), with the same verdict on every process; None where the folder has none."""
    if not config.data.glue_dir:
        return None
    path = glue_tsv.diagnostic_path(local_glue_dir(config))
    if not on_every_process(path.is_file()):
        return None
    examples, failure = None, None
    try:
        examples = glue_tsv.parse_diagnostic(path)
    except OSError as err:    # a disk or network error: every host must still reach the vote below
        failure = UserError(f"cannot read {path} ({err.strerror or type(err).__name__})", str(path),
                            "check the file, or move it aside to predict no AX set")
    except Exception as err:  # pylint: disable=broad-except  # as above
        failure = err
    if not on_every_process(failure is None):   # the same verdict on every host: predicting is collective
        raise failure or UserError(f"{path} could not be read on another host", str(path),
                                   "give every host the same data.glue_dir")
    return examples


class Runner:
    """Everything one fine-tuning run needs: tokenizer, mesh, model, jitted steps, and split evaluation."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, devices: list | None = None):
        self.config, self.workdir, self.task = config, workdir, str(config.task)
        # init_from is read until the run has a checkpoint of its own (and init_from's tokenizer copied): a resume
        # needs no source, as a continued pretraining's does not (`load_encoder` opens it for a fresh start)
        adopted = files.join(workdir, "tokenizer", "vocab.txt")
        resuming = bool(config.init_from) and bool(checkpoint_steps(workdir)) and files.isfile(adopted)
        self.source = open_init_source(config) if config.init_from and not resuming else None
        if self.source is not None:
            self.tokenizer = Tokenizer.from_file(adopt_tokenizer(self.source.workdir, workdir))
        else:
            self.tokenizer = Tokenizer.from_file(adopted) if resuming else data_lib.get_tokenizer(config, workdir)
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
        self.total_steps = int(t.steps) or (int(t.epochs) or paper_epochs(self.task)) * self.steps_per_epoch
        self.epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        check_examples(config, self.task, train=False)   # scored on dev: refused before training (train: read above)
        self.data_key = glue_fingerprint(config, self.task)     # stored with the checkpoints: resume on the same data
        self.diagnostic = read_diagnostic(config) if self.task == "mnli" and bool(t.predict_test) else None
        self.tx, self.schedule = make_optimizer(schedule_section(config, self.total_steps))
        self.init_fn = trainer_lib.init_state_fn(self.model, self.tx, int(config.model.max_len))
        self.step_fn = trainer_lib.make_train_step(make_loss_fn(self.model), self.tx, self.schedule,
                                                   int(t.grad_accum_steps), str(t.get("dropout_rng", "threefry2x32")))
        self.eval_step = make_eval_step(self.model)   # jitted by `bind` once the trainer's shardings exist

    def bind(self, params_sharding: Any) -> None:
        """Jit the eval step for params laid out as `params_sharding` (the trainer's)."""
        self.eval_step = xla_options.jit(sh.with_activation_layout(make_eval_step(self.model), self.mesh),
                                         in_shardings=(params_sharding, sh.batch_sharding(self.mesh)),
                                         out_shardings=sh.replicated(self.mesh))

    def train_batches(self, epoch: int):
        return data_lib.glue_batches(self.config, self.tokenizer, self.task, "train", batch_size=self.batch_size,
                                     seed=self.seed, epoch=epoch)

    def load_encoder(self, state: dict, abstract_params: Any) -> dict:
        """A fresh state with the encoder params replaced by the pretraining checkpoint's (if init_from is set)."""
        if self.source is None and self.config.init_from:   # a resume whose checkpoints could not be read
            self.source = open_init_source(self.config)
        if self.source is not None:
            state["params"]["encoder"], self.source = restore_encoder(self.source, abstract_params["encoder"])
        return state

    def init_state(self) -> dict:
        """A fresh sharded state with `init_from`'s encoder, outside a checkpointed loop (tools and tests)."""
        trainer = trainer_lib.Trainer(self.init_fn, self.seed, self.mesh, self.step_fn)
        self.bind(trainer.shardings["params"])
        return trainer.restore_or_init(fresh=lambda s: self.load_encoder(s, trainer.abstract_params))[0]

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
        return dev_splits(self.task)

    def evaluate(self, params: Any) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for split, suffix in self.dev_splits():
            _, labels, outputs = self.predict(params, split)
            values = scores.task_metrics(self.task, labels, outputs)
            metrics.update({k + suffix: v for k, v in values.items()})
        return metrics

    def write_test_predictions(self, params: Any) -> list[str]:
        """predictions/<Task>.tsv for each available test split (+ AX.tsv for MNLI when diagnostic/ exists)."""
        out_dir, written = os.path.join(self.workdir, "predictions"), []
        splits = [("test_matched", "mnli"), ("test_mismatched", "mnli_mm")] if self.task == "mnli" \
            else [("test", self.task)]
        for split, name in splits:
            try:
                examples, missing = data_lib.glue_examples(self.config, self.task, split), None
            except UserError as err:
                examples, missing = None, err
            if not on_every_process(missing is None):   # predict is collective: all processes, or none
                log.warning("no test predictions for %s %s: %s", self.task, split, missing or "not on every host")
                continue
            try:
                positions, _, outputs = self.predict(params, split)
            except UserError as err:      # the same on every process (the same files): all skip it
                log.warning("no test predictions for %s %s: %s", self.task, split, err)
                continue
            if jax.process_index() == 0:
                written.append(scores.write_submission(out_dir, name, [examples[i]["idx"] for i in positions], outputs))
        if self.task == "mnli":
            written += self._write_ax(params, out_dir)
        return written

    def _write_ax(self, params: Any, out_dir: str) -> list[str]:
        if self.diagnostic is None:
            return []
        enc = classification.encode_glue(self.tokenizer, self.diagnostic, int(self.config.model.max_len), False)
        if enc.num_truncated:      # as `encoded_split` says of every other split
            print(f"data: mnli diagnostic (AX): {enc.num_truncated} of {len(self.diagnostic)} examples cut to "
                  f"max_len {self.config.model.max_len} tokens", flush=True)
        batches = classification.GlueBatches(enc, batch_size=int(self.config.train.eval_batch_size),
                                        max_len=int(self.config.model.max_len),
                                        buckets=tuple(self.config.data.glue_buckets), shuffle=False, seed=0, epoch=0,
                                        drop_remainder=False, process_index=jax.process_index(),
                                        process_count=jax.process_count())
        positions, _, outputs = self.predict_batches(params, batches)
        if jax.process_index() != 0:
            return []
        return [scores.write_submission(out_dir, "ax", [self.diagnostic[i]["idx"] for i in positions], outputs)]

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
