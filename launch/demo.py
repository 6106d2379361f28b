"""`python -m launch demo` (the README's first command): pretrain a tiny TUPE-R MLM on the embedded corpus (the
documentation text CPython ships), checkpoint, evaluate the last checkpoint, plot the loss curve."""
from __future__ import annotations

import os
import signal
from typing import Any

from configs import pretrain as pretrain_config
from tupe_jax import checkpoint as ckpt_lib
from tupe_jax import metrics as metrics_lib
from tupe_jax import plots
from tupe_jax import workdir as workdir_lib
from tupe_jax.config import apply_overrides
from tupe_jax.errors import UserError
from tupe_jax.pretrain.evaluate import evaluate
from tupe_jax.pretrain.loop import pretrain


def demo_config() -> Any:
    """The demo's fixed settings: `configs/pretrain.py` tiny TUPE-R MLM, 500 steps of 32 sequences."""
    config = pretrain_config.get_config("pe=tupe_r,size=tiny,objective=mlm")
    apply_overrides(config, {"train.steps": "500", "train.batch_size": "32", "train.warmup_steps": "50",
                             "train.log_every": "25", "train.eval_every": "100", "checkpoint.every": "100"})
    return config


def demo(workdir: str) -> dict[str, Any]:
    """Pretrain, evaluate and plot; returns the evaluation metrics."""
    config = demo_config()
    try:             # before the banner: a folder of another run is the user's, not the demo's to train on
        workdir_lib.check_config(workdir, config)
    except UserError as err:
        raise UserError(err.what, err.where, "give the demo a folder of its own (it trains its fixed settings), "
                        "e.g. --workdir=runs/demo") from None
    steps = int(config.train.steps)
    if _finished(workdir, steps):   # the loop would say "nothing to train ... give a larger train.steps"
        print(f"demo: {workdir} finished its {steps} steps before (remove the folder to train again)", flush=True)
        final = {"step": steps}
    else:
        print(f"demo: tiny TUPE-R MLM ({config.model.num_layers} layers, d={config.model.hidden_size}) on the "
              f"embedded corpus (CPython's documentation text), {steps} steps, workdir {workdir}", flush=True)
        final = pretrain(config, workdir)
    if int(final.get("step", 0)) < steps or ckpt_lib.stop_requested():     # SIGTERM: saved (if past step 1), stop
        print(f"demo: stopped at step {final.get('step', 0)} of {steps} (SIGTERM); rerun `make demo` (or this "
              "command) to continue from its last checkpoint", flush=True)
        return {}
    signal.signal(signal.SIGTERM, signal.SIG_DFL)     # nothing left to save: a SIGTERM now ends the demo at once
    rows = metrics_lib.read_metrics(workdir)
    history = [m for m in rows if "loss" in m and "split" not in m]
    evals = [m for m in rows if "eval_loss" in m and "split" not in m]
    # the loop's evaluation of the last step (written once, also when a rerun finds the run finished)
    values = next((m for m in reversed(evals) if m["step"] == steps), None) or evaluate(workdir)
    png = plots.loss_curve(history, os.path.join(workdir, "loss.png"), title="demo: TUPE-R MLM, embedded corpus",
                           eval_history=evals)
    first, last = history[0], history[-1]
    print(f"\nloss: step {first['step']} {first['loss']:.3f} -> step {last['step']} {last['loss']:.3f}; "
          f"validation loss {values['eval_loss']:.3f}, MLM accuracy {values['eval_mlm_accuracy']:.3f}")
    print(f"results: {workdir}/metrics.jsonl, {png}, checkpoints in {workdir}/checkpoints, "
          f"TensorBoard in {workdir}/tensorboard")
    return values


def _finished(workdir: str, steps: int) -> bool:
    """The demo's run is at its last step and its final evaluation is written."""
    done = workdir_lib.checkpoint_steps(workdir) if os.path.isdir(workdir) else []
    return bool(done) and done[-1] >= steps and os.path.isfile(os.path.join(workdir, "metrics.jsonl")) and any(
        m.get("step") == steps and "eval_loss" in m and "split" not in m for m in metrics_lib.read_metrics(workdir))
