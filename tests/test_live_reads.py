"""Reading a pretraining run that is still training: between the listing of its checkpoints and the end of a read,
its retention (checkpoint.keep) may delete the step being read and save a newer one. `evaluate`, `export` and the
analyses (`load_run`) and a fine-tune's `init_from` then read the newest step where no step was asked for, and stop
with one line naming the steps kept where one was; a fine-tune resumed later reports the step its first start read.

The live run is simulated: the first params read of a test saves step 20 (other params) and deletes step 10 first,
as the trainer's save and retention would between the reader's listing and its read."""
import json
import os
import shutil

import jax
import numpy as np
import pytest

from tests.glue_fixtures import load_config_module, make_pretrained, tiny_model_overrides, write_glue_dir
from tupe_jax import checkpoint as ckpt
from tupe_jax import workdir as workdir_lib
from tupe_jax.errors import UserError
from tupe_jax.finetune import loop as ft_loop
from tupe_jax.finetune import runner as ft_runner


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    os.environ["TUPE_JAX_CACHE"] = str(root / "cache")
    params = make_pretrained(root / "pre", root / "cache")
    write_glue_dir(str(root / "glue"), {"rte": (64, 16, 8)})
    return root, params


@pytest.fixture
def pre(made, tmp_path):
    shutil.copytree(made[0] / "pre", tmp_path / "pre")
    return str(tmp_path / "pre")


def other_params(params):
    return jax.tree_util.tree_map(lambda x: np.asarray(x) * 2 + 1, params)


def save_step(pre, step, params):
    """A checkpoint as the trainer writes it (state, data, meta)."""
    config = workdir_lib.read_config(pre)
    state = {"step": np.int32(step), "params": params, "opt_state": (), "rng": jax.random.PRNGKey(0)}
    with ckpt.Checkpointer(pre, async_=False) as c:
        c.save(step, state, data_state={}, meta=workdir_lib.make_meta(config, params), force=True)


def train_on_during_first_read(monkeypatch, pre, params20):
    """The first `restore_params` call finds step 20 saved and step 10 deleted, as a live run's next save does."""
    original, calls = ckpt.restore_params, []

    def restore_params(path, step=None, abstract_params=None, **flags):
        if not calls:
            save_step(pre, 20, params20)
            shutil.rmtree(os.path.join(pre, "checkpoints", "10"))
        calls.append(step)
        return original(path, step, abstract_params, **flags)

    monkeypatch.setattr(ckpt, "restore_params", restore_params)
    return calls


def assert_same(a, b):
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ================================================================================================ load_run
def test_load_run_reads_the_newest_step_when_the_one_listed_is_deleted(made, pre, monkeypatch):
    params20 = other_params(made[1])
    calls = train_on_during_first_read(monkeypatch, pre, params20)
    run = workdir_lib.load_run(pre)
    assert calls == [10, 20] and run.step == 20
    assert_same(run.params, params20)


def test_load_run_of_an_asked_step_deleted_meanwhile_is_one_line(made, pre, monkeypatch):
    train_on_during_first_read(monkeypatch, pre, other_params(made[1]))
    before = sorted(os.listdir(os.path.join(pre, "checkpoints")))
    with pytest.raises(UserError) as info:
        workdir_lib.load_run(pre, 10)
    message = str(info.value)
    assert "\n" not in message and "checkpoint step 10 of" in message and "deleted while it was being read" in message
    assert "--step" in message and "[20]" in message
    assert sorted(os.listdir(os.path.join(pre, "checkpoints"))) == sorted(set(before) - {"10"} | {"20"})


def test_a_failure_of_a_kept_step_is_not_retried(pre, monkeypatch):
    calls = []

    def broken(path, step=None, abstract_params=None):
        calls.append(step)
        raise OSError("injected read failure")

    monkeypatch.setattr(ckpt, "restore_params", broken)
    with pytest.raises(OSError, match="injected read failure"):
        workdir_lib.load_run(pre)
    assert calls == [10]


# ================================================================================================ init_from
def glue_config(made, pre, **overrides):
    config = load_config_module("glue").get_config("task=rte,pe=tupe_r,size=tiny")
    tiny_model_overrides(config)
    config.data.cache_dir = str(made[0] / "cache")
    config.data.glue_dir, config.data.glue_buckets = str(made[0] / "glue"), (32, 64)
    config.init_from = pre
    config.train.update(dict(dict(batch_size=16, eval_batch_size=16, log_every=2, learning_rate=1e-3), **overrides))
    config.checkpoint.async_save = False
    return config


def test_init_from_reads_the_newest_step_when_the_one_listed_is_deleted(made, pre, tmp_path, monkeypatch):
    runner = ft_runner.Runner(glue_config(made, pre), str(tmp_path / "ft"))
    assert runner.source.step == 10
    params20 = other_params(made[1])
    calls = train_on_during_first_read(monkeypatch, pre, params20)
    state = runner.init_state()
    assert calls == [10, 20] and runner.source.step == 20 and runner.source.meta["pe"] == "tupe_r"
    assert_same(state["params"]["encoder"], params20["encoder"])


def test_init_from_reads_the_newest_step_when_the_one_it_chose_is_gone_before_the_read(made, pre, tmp_path):
    """The live run's retention deleted the step the fine-tune chose (opening init_from) before the encoder's read
    listed the checkpoints: that read takes the newest step, as it does when the step goes during the read."""
    runner = ft_runner.Runner(glue_config(made, pre), str(tmp_path / "ft"))
    assert runner.source.step == 10
    params20 = other_params(made[1])
    save_step(pre, 20, params20)
    shutil.rmtree(os.path.join(pre, "checkpoints", "10"))
    state = runner.init_state()
    assert runner.source.step == 20
    assert_same(state["params"]["encoder"], params20["encoder"])


def test_init_from_an_asked_step_deleted_meanwhile_is_one_line(made, pre, tmp_path, monkeypatch):
    config = glue_config(made, pre)
    config.init_step = 10
    runner = ft_runner.Runner(config, str(tmp_path / "ft"))
    train_on_during_first_read(monkeypatch, pre, other_params(made[1]))
    with pytest.raises(UserError) as info:
        runner.init_state()
    message = str(info.value)
    assert "\n" not in message and "checkpoint step 10 of" in message and "--config.init_from" in message
    assert "[20]" in message


def test_a_resumed_finetune_reports_the_step_its_first_start_read(made, pre, tmp_path):
    config = glue_config(made, pre, steps=4, predict_test=False)
    config.checkpoint.every = 2
    first = ft_loop.finetune(config, str(tmp_path / "ft"))
    assert first["init_step"] == 10
    shutil.rmtree(tmp_path / "ft" / "checkpoints" / "4")        # interrupted after step 2 ...
    os.remove(tmp_path / "ft" / "results.json")
    save_step(pre, 20, other_params(made[1]))                     # ... while the pretraining run went on
    again = ft_loop.finetune(config, str(tmp_path / "ft"))
    assert again["init_step"] == 10 and again["init_from"] == pre
    assert json.load(open(tmp_path / "ft" / "results.json"))["init_step"] == 10


# ================================================================================================ several processes
def as_process_1_of_2(monkeypatch, process0_chooses, process0_reads):
    """This process as process 1 of 2 (its two collectives faked): `_agreed` gives process 0's step,
    `process0_chooses(own choice)`, and `sharding.gathered` puts process 0's status for each attempt (`process0_reads`, in
    order) before this process's."""
    from tupe_jax.workdir import meta
    statuses = list(process0_reads)
    monkeypatch.setattr(meta, "_agreed", lambda own: process0_chooses(own))
    monkeypatch.setattr(meta.sharding, "gathered", lambda mine: [statuses.pop(0), mine])
    return meta


def test_processes_read_the_step_process_0_chose_even_one_this_process_did_not_list_yet(made, pre, monkeypatch):
    def process0_chooses(own):
        assert own == 10
        save_step(pre, 20, other_params(made[1]))    # process 0 listed after the live run's next save
        return 20

    meta = as_process_1_of_2(monkeypatch, process0_chooses, [0])     # process 0: READ
    reads = []
    assert meta.read_kept_step(pre, None, lambda at: reads.append(at) or at) == (20, 20)
    assert reads == [20]


def test_processes_retry_together_when_another_ones_read_lost_the_step(pre, monkeypatch):
    meta = as_process_1_of_2(monkeypatch, lambda own: own, [1, 0])      # process 0: DELETED, then READ
    reads = []
    assert meta.read_kept_step(pre, None, lambda at: reads.append(at) or "params") == (10, "params")
    assert reads == [10, 10]                                            # all processes took a second attempt
    meta = as_process_1_of_2(monkeypatch, lambda own: own, [1])
    with pytest.raises(UserError, match="checkpoint step 10 of .* was deleted while it was being read"):
        meta.read_kept_step(pre, 10, lambda at: "params", follow=False)


def test_processes_stop_together_when_another_ones_read_failed(pre, monkeypatch):
    meta = as_process_1_of_2(monkeypatch, lambda own: own, [2])         # process 0: FAILED
    with pytest.raises(UserError, match="process 0 could not read checkpoint step 10 of"):
        meta.read_kept_step(pre, None, lambda at: "params")


def test_each_attempt_lists_once_whatever_this_processs_outcome(made, pre, monkeypatch):
    """An Orbax listing is a collective call on several processes: only the processes whose read failed asking
    for one more would leave the others' collectives out of step. Here this process's read loses step 10 to the
    live run while process 0's succeeded; both retry, and this process listed once per attempt."""
    meta = as_process_1_of_2(monkeypatch, lambda own: own, [0, 0])      # process 0: READ, READ
    listings, original = [], meta.checkpoint_steps
    monkeypatch.setattr(meta, "checkpoint_steps", lambda w: listings.append(w) or original(w))
    reads = []

    def read(at):
        reads.append(at)
        if len(reads) == 1:
            save_step(pre, 20, other_params(made[1]))
            shutil.rmtree(os.path.join(pre, "checkpoints", "10"))
            raise OSError("the step went away")
        return at

    assert meta.read_kept_step(pre, None, read) == (20, 20)
    assert reads == [10, 20] and len(listings) == 2
