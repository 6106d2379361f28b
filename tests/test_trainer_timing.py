"""The trainer's step_time_s (and the tokens/s and MFU made from it) times the steps alone: an evaluation or a
checkpoint save after a step belonged to the next logged window (at the step after an evaluation, that window took
the evaluation's time and its compile)."""
import time

import jax.numpy as jnp
import numpy as np

from tupe_jax import checkpoint as ckpt_lib
from tupe_jax import config as config_lib
from tupe_jax import sharding as sharding_lib
from tupe_jax import trainer as trainer_lib


def test_step_time_leaves_out_the_evaluation_after_a_step(tmp_path):
    def init_fn(rng):
        del rng
        return {"params": {"w": jnp.zeros((4,))}, "step": jnp.zeros((), jnp.int32)}

    def step_fn(state, batch):
        loss = batch["x"].mean()
        return {"params": {"w": state["params"]["w"] + loss}, "step": state["step"] + 1}, {"loss": loss}

    mesh = sharding_lib.make_mesh(config_lib.load_config("configs/pretrain.py:pe=bert_a,size=tiny").mesh)
    trainer = trainer_lib.Trainer(init_fn, 0, mesh, step_fn,
                                  ckpt_lib.Checkpointer(str(tmp_path), every=1000, keep=1, async_=False), log_every=1)
    state, _ = trainer.restore_or_init()
    rows = {}
    hooks = trainer_lib.Hooks(log=lambda step, values: rows.update({step: values["step_time_s"]}),
                              after_step=lambda step, _: time.sleep(1.0) if step == 3 else None,   # an evaluation
                              sync_due=lambda step: step == 3)
    trainer.fit(state, ({"x": np.ones((8, 4), np.float32)} for _ in range(6)), 6, hooks)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    assert max(rows[s] for s in (2, 3, 4, 5, 6)) < 0.2, rows        # the window after step 3 took 0.5 s a step
