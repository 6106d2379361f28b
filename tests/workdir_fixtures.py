"""Helpers shared by the run-folder tests (test_workdir, test_workdir_processes, test_lock): the repo root, a tiny
pretraining config, a hash of every file in a folder (to show a refused command left it byte-identical) and a
committed checkpoint with tiny params."""
import hashlib
import os

import jax.numpy as jnp

from tupe_jax import checkpoint as ckpt
from tupe_jax import config as config_lib
from tupe_jax import workdir as workdir_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(arg="pe=tupe_r", **overrides):
    config = config_lib.load_config(os.path.join(ROOT, "configs", "pretrain.py") + ":" + arg)
    return config_lib.apply_overrides(config, {k: str(v) for k, v in overrides.items()})


def tree(path):
    """{relative path: sha1} of every file under `path`."""
    out = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha1(f.read()).hexdigest()
    return out


# a process that holds `RunLock(argv[1])` for argv[2] seconds, printing `locked` once it does
LOCKER = r'''
import sys, time
from tupe_jax.workdir import RunLock
with RunLock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
'''


def fake_checkpoint(workdir, config, step):
    """A committed checkpoint of `config` at `step` (tiny params; the gate reads only its meta)."""
    params = {"w": jnp.ones((2,))}
    with ckpt.Checkpointer(workdir, async_=False) as c:
        c.save(step, {"step": jnp.int32(step), "params": params}, {}, workdir_lib.make_meta(config, params),
               force=True)
