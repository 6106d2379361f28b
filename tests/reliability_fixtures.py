"""Helpers for the reliability tests (test_reliability, test_security): a tiny pretraining config, a child process
that trains a workdir and interrupts itself where it is told (CHILD), and what a workdir's checkpoints hold.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np

from configs import pretrain as pretrain_config
from tests import xla_flags
from tupe_jax import config as config_lib
from tupe_jax import workdir as workdir_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TMP_SUFFIX = ".orbax-checkpoint-tmp"

# The child: train the workdir's config.json; KILL = {"phase": ..., ...} picks where it interrupts itself:
#   step   SIGKILL at the start of the `calls`-th step of this invocation (between checkpoints)
#   save   SIGKILL right after the asynchronous save of `step` was started (its files are being written)
#   commit SIGKILL when the save of `step` has written everything and is about to rename (commit) it
#   term   SIGTERM at the start of the `calls`-th step (graceful: save the current step, exit 0)
#   int    SIGINT (Ctrl-C) at the start of the `calls`-th step (save the current step, exit 130)
CHILD = r'''
import json, os, signal, sys, time
import tupe_jax.sharding as sh
from tupe_jax import checkpoint as ckpt, workdir
from tupe_jax.pretrain import loop
wd, kill = sys.argv[1], json.loads(os.environ.get("KILL", "null"))
signal.signal(signal.SIGINT, signal.default_int_handler)   # Ctrl-C as in a terminal, whatever the suite inherited
def hit(sig):
    with open(os.path.join(wd, "interrupted_at"), "w") as f:
        f.write(str(time.time()))
    os.kill(os.getpid(), sig)
if kill and kill["phase"] in ("step", "term", "int"):
    original, calls = sh.global_batch, [0]
    def global_batch(*a, **k):
        calls[0] += 1
        if calls[0] == kill["calls"]:
            hit({"step": signal.SIGKILL, "term": signal.SIGTERM, "int": signal.SIGINT}[kill["phase"]])
        return original(*a, **k)
    sh.global_batch = global_batch
if kill and kill["phase"] == "save":
    original_save = ckpt.Checkpointer.save
    def save(self, step, *a, **k):
        out = original_save(self, step, *a, **k)
        if step == kill["step"]:
            hit(signal.SIGKILL)
        return out
    ckpt.Checkpointer.save = save
if kill and kill["phase"] == "commit":
    from orbax.checkpoint._src.path import atomicity
    original_finalize = atomicity.AtomicRenameTemporaryPath.finalize
    async def finalize(self, *a, **k):
        if self.get_final().name == str(kill["step"]):
            hit(signal.SIGKILL)
        return await original_finalize(self, *a, **k)
    atomicity.AtomicRenameTemporaryPath.finalize = finalize
try:
    loop.pretrain(workdir.read_config(wd), wd)
except KeyboardInterrupt:
    sys.exit(130)
'''


def tiny_config(cache_dir, steps, **extra):
    config = pretrain_config.get_config("pe=tupe_r")
    overrides = {"model.hidden_size": "32", "model.num_layers": "2", "model.num_heads": "2", "model.mlp_dim": "64",
                 "model.vocab_size": "512", "model.max_len": "32", "train.steps": str(steps),
                 "train.batch_size": "16", "train.learning_rate": "3e-3", "train.warmup_steps": "5",
                 "train.log_every": "1", "train.eval_every": "0", "train.eval_steps": "2", "checkpoint.every": "5",
                 "checkpoint.async_save": "true", "data.cache_dir": str(cache_dir)}
    overrides.update({k: str(v) for k, v in extra.items()})
    config_lib.apply_overrides(config, overrides)
    return config



def run_child(workdir, kill=None, timeout=300):
    env = dict(os.environ, XLA_FLAGS=xla_flags.devices(1), KILL=json.dumps(kill),
               PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", CHILD, str(workdir)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def committed(workdir):
    return sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())


def leftovers(workdir):
    return sorted(d for d in os.listdir(os.path.join(workdir, "checkpoints")) if TMP_SUFFIX in d)


def params_of(workdir):
    return jax.tree_util.tree_map(np.asarray, workdir_lib.load_run(str(workdir)).params)


def assert_params_equal(a, b):
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(x, y)
