"""GLUE fine-tuning config: one task, one positional scheme, the model shape of a pretraining size preset.

Arg (comma-separated, all optional): `task=<cola|sst2|mrpc|stsb|qqp|mnli|qnli|rte|wnli|wordorder>` (default rte),
`pe=<scheme>` (default tupe_r), `size=tiny|small|medium|base|large` (default tiny), `objective=mlm|clm` (default mlm).
`model.*` is built exactly as in `configs/pretrain.py`. With `init_from`, the launcher then sets the model keys that
must match the pretraining run (`tupe_jax/finetune/init_from.py:MUST_MATCH`) to that run's, except those the
command line gives (`pe=`, `size=`, `objective=` here, `--config.model.KEY`), which must equal the run's.

Ready-to-paste commands:

    # fine-tune a pretraining run on RTE (data.glue_dir: the download_glue_data.py layout); the model is the run's
    python -m launch finetune --config=configs/glue.py:task=rte --workdir=runs/x-rte \
        --config.init_from=runs/x --config.data.glue_dir=../shared/data/glue

    # the same from a given pretraining step, or from scratch (a baseline: leave init_from unset)
    python -m launch finetune --config=configs/glue.py:task=rte --workdir=runs/x-rte-300 \
        --config.init_from=runs/x/checkpoints/300 --config.data.glue_dir=../shared/data/glue

    # the built-in offline word-order task (no files needed), a few minutes on a laptop CPU
    python -m launch finetune --config=configs/glue.py:task=wordorder --workdir=runs/x-wordorder --config.init_from=runs/x

    # the paper's protocol: lr grid x 5 seeds per task, median of the best lr (resumable; writes sweep.md/json)
    python -m launch glue-sweep --config=configs/glue.py --workdir=runs/x-glue \
        --config.init_from=runs/x --config.data.glue_dir=PATH --config.sweep.tasks=cola,sst2,mrpc,stsb,rte

    # a small CPU sweep: 2 lrs x 2 seeds, 1 epoch
    python -m launch glue-sweep --config=configs/glue.py:task=wordorder --workdir=runs/x-sweep \
        --config.init_from=runs/x --config.sweep.learning_rates='(1e-4,3e-4)' --config.sweep.seeds='(0,1)' \
        --config.train.epochs=1

Keys beyond pretraining's:
  task            the GLUE task (or `wordorder`);
  init_from       '' = train from scratch (a baseline); else a pretraining workdir or `<workdir>/checkpoints/<step>`;
  init_step       -1 = the latest checkpoint of `init_from` (when init_from names a step, leave it or give that step);
  train.epochs    0 = the paper's count (10; 5 for MNLI, QNLI, QQP);
  train.steps     0 = epochs x (train examples // batch_size); > 0 = exactly that many steps (smoke tests);
  train.warmup_ratio  linear warmup over this fraction of the steps, then linear decay to 0 (paper: 0.06);
  train.eval_every    0 = evaluate on dev at the end of every epoch; > 0 = also every N steps;
  train.predict_test  write predictions/<Task>.tsv (GLUE submission format) from the best-dev evaluation;
  sweep.tasks     '' = just `task`; else comma-separated tasks for `glue-sweep`;
  sweep.learning_rates / sweep.seeds   the grid (paper: 2e-5..5e-5 x 5 seeds).
"""
from __future__ import annotations

import os

import ml_collections

from tupe_jax.config import load_config, lock, parse_arg
from tupe_jax.data import GLUE_TASKS
from tupe_jax.errors import UserError


def _pretrain_config(arg: str):
    """`configs/pretrain.py:get_config(arg)`, found next to this file (works wherever configs/ is)."""
    return load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "pretrain.py") + ":" + arg)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """Build the locked fine-tuning config for `arg` = "task=...,pe=...,size=...,objective=..."."""
    arg = parse_arg(arg, task="rte", pe="tupe_r", size="tiny", objective="mlm")
    if arg.task not in GLUE_TASKS:
        raise UserError(f"unknown GLUE task task={arg.task!r}", "--config=configs/glue.py:task=...",
                        "use one of " + "|".join(GLUE_TASKS))
    pre = _pretrain_config(f"pe={arg.pe},size={arg.size},objective={arg.objective}")

    config = ml_collections.ConfigDict()
    config.task = arg.task
    config.init_from = ""
    config.init_step = -1
    config.model = ml_collections.ConfigDict(pre.model.to_dict())  # identical to pretraining: shapes match
    config.data = ml_collections.ConfigDict(pre.data.to_dict())
    config.train = ml_collections.ConfigDict(dict(
        batch_size=32, eval_batch_size=64, learning_rate=2e-5, epochs=0, steps=0, warmup_ratio=0.06, seed=0,
        weight_decay=0.01, clip_norm=1.0, adam_b1=0.9, adam_b2=0.999, adam_eps=1e-6, grad_accum_steps=1,
        log_every=50, eval_every=0, predict_test=True,
        dropout_rng="threefry2x32",       # threefry2x32 | rbg | unsafe_rbg (see configs/pretrain.py)
    ))
    config.sweep = ml_collections.ConfigDict(dict(
        tasks="", learning_rates=(2e-5, 3e-5, 4e-5, 5e-5), seeds=(0, 1, 2, 3, 4),
    ))
    config.mesh = ml_collections.ConfigDict(pre.mesh.to_dict())
    config.checkpoint = ml_collections.ConfigDict(dict(every=1000, keep=2, async_save=True))
    return lock(config)
