"""The fine-tuning loop: `finetune(config, workdir)` — one task, one learning rate, one seed — over
`trainer.Trainer`.

Protocol (TUPE App. B): batch 32, lr in {2,3,4,5}e-5, 10 epochs (5 for MNLI/QNLI/QQP), 6 % warmup then linear
decay, AdamW (b=(0.9, 0.999), eps 1e-6, wd 0.01, clip 1.0), dropout 0.1. The dev set is evaluated at the end of
every epoch (and every `train.eval_every` steps); the run's number is its best dev evaluation (fairseq's
checkpoint_best, as the paper's code selects), and its test predictions come from that same evaluation.

Workdir: config.json, metrics.jsonl (train rows: step, epoch, loss, learning_rate, grad_norm; eval rows:
eval_<metric>), checkpoints/ (state + {'best', 'last_eval', 'predictions'} as the data item; restarting
resumes), results.json, predictions/<Task>.tsv.
"""
from __future__ import annotations

import itertools
import os
from typing import Any, Iterator

import jax
import ml_collections

from tupe_jax import checkpoint as ckpt_lib
from tupe_jax import files
from tupe_jax import metrics as metrics_lib
from tupe_jax import trainer as trainer_lib
from tupe_jax import workdir as workdir_lib
from tupe_jax.errors import require
from tupe_jax.finetune import scores
from tupe_jax.finetune.runner import Runner
from tupe_jax.finetune.validate import validate


def _epochs_from(runner: Runner, step: int) -> Iterator[Any]:
    """Training batches from global step `step` on, epoch after epoch (each epoch its own shuffle)."""
    spe = runner.steps_per_epoch
    for epoch in itertools.count(step // spe):
        skip = step - epoch * spe if epoch == step // spe else 0
        yield from itertools.islice(iter(runner.train_batches(epoch)), skip, None)


def finetune(config: ml_collections.ConfigDict, workdir: str, devices: list | None = None) -> dict[str, Any]:
    """Fine-tune `config.task` in `workdir` (resuming from its latest checkpoint); returns results.json's dict.

    `devices`: the devices of the mesh (default: all; the launcher always uses all).
    """
    devices = list(devices) if devices is not None else jax.devices()
    validate(config, len(devices))
    with workdir_lib.claim(workdir, config, kind="finetune"):   # the gate: same run, one process, undo on failure
        return _finetune(config, workdir, devices)


def _finetune(config: ml_collections.ConfigDict, workdir: str, devices: list) -> dict[str, Any]:
    # --------------------------------------------------------------------------------------- setup
    runner = Runner(config, workdir, devices)
    task, total, spe = runner.task, runner.total_steps, runner.steps_per_epoch
    key = scores.headline_key(task)
    t = config.train

    # --------------------------------------------------------------------------------------- state
    checkpointer = ckpt_lib.Checkpointer(workdir, every=int(config.checkpoint.every), keep=int(config.checkpoint.keep),
                                         async_=bool(config.checkpoint.async_save))
    trainer = trainer_lib.Trainer(runner.init_fn, runner.seed, runner.mesh, runner.step_fn, checkpointer,
                                  meta=lambda s: workdir_lib.make_meta(config, s["params"]),
                                  log_every=int(t.log_every))
    runner.bind(trainer.shardings["params"])
    state, progress = trainer.restore_or_init(fresh=lambda s: runner.load_encoder(s, trainer.abstract_params))
    resumed = progress is not None
    source = {"workdir": runner.source.workdir, "step": runner.source.step,
              "checkpoint": workdir_lib.checkpoint_identity(runner.source.workdir, runner.source.step)} \
        if runner.source else \
        ({"workdir": str(config.init_from), "step": None} if config.init_from else None)   # a resume read none
    if progress is None:    # the checkpoint read now; a resumed run reports the one its first start read
        progress = {"best": None, "last_eval": None, "predictions": [], "init": source, "data": runner.data_key,
                    "process_count": jax.process_count()}
    else:
        saved = progress.setdefault("data", runner.data_key)   # runs saved before the field: not checked
        require(saved == runner.data_key, f"the {task} examples differ from those this run started on (the files "
                f"in data.glue_dir changed since; {saved} then, {runner.data_key} now): its best dev score would "
                "compare two dev sets", "--config.data.glue_dir", "restore the files it started with, or fine-tune "
                "into a fresh workdir")
        progress.setdefault("best", None)
        progress.setdefault("predictions", [])
        progress.setdefault("init", source)     # saved by versions before the field: the checkpoint read now
        done = os.path.join(workdir, "results.json")
        if int(state["step"]) >= total and files.isfile(done):   # finished: nothing trained or rewritten
            checkpointer.close()
            print(f"{workdir} finished its {total} steps before: nothing to train (its results: {done}; give a "
                  "larger train.steps or train.epochs to train on)", flush=True)
            return files.read_json(done)
        print(f"resumed {task} from step {int(state['step'])} of {workdir}", flush=True)
    before = progress.get("process_count", jax.process_count())     # saved by versions before the field: not known
    moved = {"process_count_before": before, "process_count": jax.process_count()} \
        if resumed and before != jax.process_count() else {}
    progress["process_count"] = jax.process_count()
    if moved:    # each step's examples are the same ([p::P] of one global row), in another row order
        print(f"warning: {workdir} ran on {before} process{'es' * (before != 1)} and resumes on "
              f"{jax.process_count()}: each step takes the same examples, in another row order of the global batch "
              "(not bitwise the run it was)", flush=True)
    step = int(state["step"])
    init = progress["init"]
    origin = f"{init['workdir']} step {init['step']}" if init else "scratch (no init_from)"
    if step == 0:
        count = (f"{total} steps (train.steps; {total / spe:.3g} epochs of {spe} steps)" if int(t.steps)
                 else f"{total} steps = {runner.epochs} epochs x {spe} steps")
        print(f"fine-tuning {task} from {origin}: {count}, batch {runner.batch_size}, lr {float(t.learning_rate):g}, "
              f"seed {runner.seed}", flush=True)

    # --------------------------------------------------------------------------------------- hooks
    writer = metrics_lib.MetricsWriter(workdir, owns_folder=lambda: workdir_lib.owns_folder(workdir))
    if resumed or metrics_lib.rows_past(workdir, 0):   # the rows a stopped process wrote past its checkpoint (or
        writer.write(step, {"event": metrics_lib.RESUMED, **moved})   # before its first) are redone (read_metrics)
    bar = metrics_lib.Progress(total, step)
    eval_every = int(t.eval_every)

    def log(at: int, values: dict) -> None:
        row = {"epoch": at / spe, **{k: v for k, v in values.items() if k != "step_time_s"}}
        writer.write(at, row)
        bar.line(at, row)

    def evaluate_due(at: int) -> bool:
        return at % spe == 0 or at == total or (eval_every > 0 and at % eval_every == 0)

    def after_step(at: int, state: dict) -> None:
        if not evaluate_due(at):
            return
        metrics = runner.evaluate(state["params"])
        epoch = at / spe
        writer.write(at, {"epoch": epoch, **{f"eval_{k}": v for k, v in metrics.items()}})
        print(f"eval {task} step {at} epoch {epoch:.2f} | "
              + " | ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
        progress["last_eval"] = {"step": at, "epoch": epoch, "metrics": metrics}
        best = progress["best"]
        if best is None or metrics[key] > best["metrics"][key]:
            progress["best"] = {"step": at, "epoch": epoch, "metrics": metrics}
            if bool(t.predict_test):
                progress["predictions"] = runner.write_test_predictions(state["params"])

    # --------------------------------------------------------------------------------------- loop
    hooks = trainer_lib.Hooks(log=log, after_step=after_step, payload=lambda: progress,
                              checkpoint_due=lambda at: at % spe == 0, sync_due=evaluate_due)
    with metrics_lib.closed_on_error(writer):
        outcome = trainer.fit(state, _epochs_from(runner, step), total, hooks)
    checkpointer.close()
    writer.close()
    if outcome.preempted:
        return {"preempted": True, "step": outcome.step}

    # --------------------------------------------------------------------------------------- results
    best, last = progress["best"], progress["last_eval"]
    results = {
        "task": task, "headline_key": key, "score": best["metrics"][key] if best else None,
        "best": best, "final": last, "steps": total, "epochs": total / spe, "steps_per_epoch": spe,   # epochs trained
        "batch_size": runner.batch_size, "learning_rate": float(t.learning_rate), "seed": runner.seed,
        "init_from": init["workdir"] if init else "", "init_step": init["step"] if init else None,
        "init_checkpoint": init.get("checkpoint", "") if init else "",   # '' = not known (meta.checkpoint_identity)
        "majority_baseline": runner.majority_baseline(), "predictions": progress.get("predictions", []),
        "data": progress["data"],      # the examples' key (`glue_fingerprint`): a sweep reuses the run on them alone
    }
    if jax.process_index() == 0:
        files.write_json(os.path.join(workdir, "results.json"), results)
    return results
