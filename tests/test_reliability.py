"""Reliability (issue #8): kill -9 / SIGTERM / corrupt checkpoints / divergence / disk full / restore never unpickles.
(No pickle in the package, config files, no network: test_security.py.)

Subprocess runs use ONE CPU device (XLA_FLAGS in their env) to stay fast; the reference run is a subprocess with the
same flags, so "bitwise equal" compares like with like. Interruptions are made deterministic by a small hook the
child installs before training (see CHILD): it sends itself SIGKILL (a real kill -9) or SIGTERM at a chosen point.
"""
from __future__ import annotations

import glob
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests import xla_flags
from tests.reliability_fixtures import (ROOT, TMP_SUFFIX, assert_params_equal, committed, leftovers,
                                       params_of, run_child, tiny_config)
from tupe_jax import checkpoint as ckpt
from tupe_jax import trainer as trainer_lib
from tupe_jax import workdir as workdir_lib
from tupe_jax.model import ModelConfig, TransformerLM
from tupe_jax.pretrain import loop as pretrain_loop
from tupe_jax.errors import UserError


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache")
    old = os.environ.get("TUPE_JAX_CACHE")
    os.environ["TUPE_JAX_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("TUPE_JAX_CACHE", None)
    else:
        os.environ["TUPE_JAX_CACHE"] = old


# ================================================================================================ kill -9 / SIGTERM
STEPS = 30


@pytest.fixture(scope="module")
def uninterrupted(cache_dir, tmp_path_factory):
    """The reference both interruption tests compare to: the tiny config's STEPS steps in one child process."""
    ref = tmp_path_factory.mktemp("ref") / "uninterrupted"
    config = tiny_config(cache_dir, STEPS)
    workdir_lib.write_config(str(ref), config)
    result = run_child(ref)
    assert result.returncode == 0, result.stderr[-3000:]
    return ref, config


@pytest.mark.slow
def test_kill9_at_random_steps_and_sigterm_resume_bitwise(uninterrupted, tmp_path):
    steps, every = STEPS, 5
    ref, config = uninterrupted
    run = tmp_path / "interrupted"
    workdir_lib.write_config(str(run), config)

    rng = np.random.default_rng(8)                     # three random kill points, fixed by the seed
    commit_at = int(rng.choice([5, 10]))               # killed while committing an async save (all files written)
    save_at = int(rng.choice([s for s in (15, 20) if s > commit_at]))   # killed mid-write of an async save
    step_at = int(rng.choice([s for s in range(save_at - 4, save_at + 4) if s % every]))  # between checkpoints
    term_at = 27                                        # SIGTERM: checkpoint the current step, exit 0
    resume = 0
    for kill, killed_step in (({"phase": "commit", "step": commit_at}, commit_at),
                              ({"phase": "save", "step": save_at}, save_at),
                              ({"phase": "step", "calls": step_at - resume}, step_at),
                              ({"phase": "term", "calls": term_at - resume}, term_at)):
        if kill["phase"] in ("step", "term"):
            kill["calls"] = killed_step - resume
        result = run_child(run, kill)
        latest = committed(run)[-1] if committed(run) else 0
        if kill["phase"] == "term":
            assert result.returncode == 0, result.stderr[-3000:]
            assert latest == term_at and f"preemption: saved step {term_at}" in result.stdout
            assert time.time() - float((run / "interrupted_at").read_text()) < 60
            assert not leftovers(run)
        else:
            assert result.returncode == -signal.SIGKILL, (kill, result.stderr[-3000:])
            if kill["phase"] in ("commit", "save"):        # the interrupted write is on disk, uncommitted
                assert f"{killed_step}{TMP_SUFFIX}" in leftovers(run), os.listdir(run / "checkpoints")
                assert latest == killed_step - every      # ... and never counted as a checkpoint
            with ckpt.Checkpointer(str(run), read_only=True) as c:
                assert c.latest_step() == latest
        if resume:
            assert f"resumed from step {resume}" in result.stdout
        resume = latest
    result = run_child(run)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from step {term_at}" in result.stdout
    assert committed(run)[-1] == steps and not leftovers(run)
    assert_params_equal(params_of(ref), params_of(run))


@pytest.mark.slow
def test_ctrl_c_checkpoints_the_step_and_the_resume_is_bitwise(uninterrupted, tmp_path):
    """Ctrl-C (SIGINT, which the child sends itself as step 13 of 30 begins): step 13 is checkpointed, the process
    exits 130 with no traceback, and the resume from it ends bitwise equal to an uninterrupted run (the one the
    kill -9 test compares to). (Python's own handler raised wherever the main thread was; inside JAX's
    garbage-collection hook the interrupt was dropped.)"""
    ref, config = uninterrupted
    run = tmp_path / "interrupted"
    workdir_lib.write_config(str(run), config)
    result = run_child(run, {"phase": "int", "calls": 13})
    assert result.returncode == 130, result.stderr[-3000:]
    assert "interrupted: saved step 13" in result.stdout and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert committed(run)[-1] == 13 and not leftovers(run)
    result = run_child(run)
    assert result.returncode == 0 and "resumed from step 13" in result.stdout, result.stderr[-3000:]
    assert committed(run)[-1] == STEPS
    assert_params_equal(params_of(ref), params_of(run))


# ================================================================================================ corrupt checkpoints
def _truncate_largest(step_dir):
    files = [f for f in glob.glob(os.path.join(step_dir, "state", "**", "*"), recursive=True) if os.path.isfile(f)]
    biggest = max(files, key=os.path.getsize)
    with open(biggest, "r+b") as f:
        f.truncate(os.path.getsize(biggest) // 2)
    return biggest


def _garbage(path):
    with open(path, "wb") as f:
        f.write(b"\x00{not json")
    return path


CORRUPTIONS = {
    "truncated_array_file": _truncate_largest,
    "garbage_state_metadata": lambda d: _garbage(os.path.join(d, "state", "_METADATA")),
    "garbage_data_state": lambda d: _garbage(os.path.join(d, "data", "metadata")),
    "garbage_meta": lambda d: _garbage(os.path.join(d, "meta", "metadata")),
    "missing_manifest": lambda d: os.remove(os.path.join(d, "state", "manifest.ocdbt")),
}


@pytest.fixture(scope="module")
def two_step_run(cache_dir, tmp_path_factory):
    """A workdir trained 10 steps with checkpoints at 5 and 10 (one device, synchronous saves)."""
    wd = tmp_path_factory.mktemp("two_steps") / "run"
    config = tiny_config(cache_dir, 10, **{"checkpoint.async_save": "false"})
    pretrain_loop.pretrain(config, str(wd), devices=jax.devices()[:1])
    assert committed(wd) == [5, 10]
    return wd, config


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_latest_checkpoint_falls_back_and_deletes_nothing(kind, two_step_run, tmp_path, caplog):
    src, config = two_step_run
    wd = tmp_path / "run"
    shutil.copytree(src, wd)
    CORRUPTIONS[kind](str(wd / "checkpoints" / "10"))
    before = sorted(os.listdir(wd / "checkpoints" / "10"))
    with caplog.at_level(logging.WARNING):
        with pytest.raises(UserError, match="step 10"):      # asked for explicitly: a one-line error
            _explicit_restore(wd, config, 10)
        state = _latest_restore(wd, config)
    assert int(state["step"]) == 5
    assert "step 10" in caplog.text and "deleting nothing" in caplog.text
    assert committed(wd) == [5, 10] and sorted(os.listdir(wd / "checkpoints" / "10")) == before


def _abstract(config):
    from tupe_jax import sharding as sh  # pylint: disable=import-outside-toplevel
    model = TransformerLM(ModelConfig.from_config(config.model))
    from tupe_jax.optim import make_optimizer  # pylint: disable=import-outside-toplevel
    tx, _ = make_optimizer(config.train)
    init_fn = trainer_lib.init_state_fn(model, tx, config.model.max_len)
    abstract = jax.eval_shape(init_fn, jax.random.PRNGKey(0))
    mesh = sh.make_mesh(config, jax.devices()[:1])
    return sh.abstract_with_shardings(abstract, sh.logical_to_shardings(abstract, mesh))


def _latest_restore(wd, config):
    with ckpt.Checkpointer(str(wd), read_only=True) as c:
        state, _ = c.restore(None, _abstract(config))
    return state


def _explicit_restore(wd, config, step):
    with ckpt.Checkpointer(str(wd), read_only=True) as c:
        return c.restore(step, _abstract(config))


@pytest.mark.slow
def test_training_continues_past_a_corrupt_step(two_step_run, tmp_path, caplog):
    """Resume from 5 (10 is truncated), train on; saving step 10 again moves the bad one aside (not deleted)."""
    src, config = two_step_run
    wd = tmp_path / "run"
    shutil.copytree(src, wd)
    damaged = _truncate_largest(str(wd / "checkpoints" / "10"))
    config = tiny_config(config.data.cache_dir, 15, **{"checkpoint.async_save": "false",
                                                       "train.decay_steps": 10})   # the run's schedule
    with caplog.at_level(logging.WARNING):
        pretrain_loop.pretrain(config, str(wd), devices=jax.devices()[:1])
    assert "checkpoint step 10" in caplog.text
    assert committed(wd) == [5, 10, 15]
    aside = glob.glob(str(wd / "checkpoints" / "10.bad-*"))
    assert len(aside) == 1
    assert os.path.isfile(damaged.replace(str(wd / "checkpoints" / "10"), aside[0]))
    assert workdir_lib.load_run(str(wd)).step == 15


@pytest.mark.slow
def test_a_damaged_step_puts_only_its_own_lines_on_stderr(two_step_run, tmp_path):
    """Real processes, on a step that lost its OCDBT manifest (the damage that leaves the most of Orbax's reads in
    flight): `evaluate` stops with its one line, exit 2; a resume falls back to step 5 and trains on. Neither prints
    a traceback of the failed read's leftovers (`tupe_jax/failed_reads.py`)."""
    src, _ = two_step_run
    wd = tmp_path / "run"
    shutil.copytree(src, wd)
    os.remove(wd / "checkpoints" / "10" / "state" / "manifest.ocdbt")
    evaluate = subprocess.run([sys.executable, "-m", "launch", "evaluate", f"--workdir={wd}"], cwd=ROOT,
                              env=dict(os.environ, XLA_FLAGS=xla_flags.devices(1)), capture_output=True, text=True,
                              timeout=300, check=False)
    assert evaluate.returncode == 2, evaluate.stderr[-3000:]
    assert evaluate.stderr.startswith("error: checkpoint step 10 ") and len(evaluate.stderr.splitlines()) == 1
    resumed = run_child(wd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert committed(wd) == [5, 10] and "checkpoint step 10" in resumed.stderr
    for leftover in ("Traceback", "Exception ignored", "Event loop is closed", "never retrieved"):
        assert leftover not in resumed.stderr, resumed.stderr[-3000:]


def test_uncommitted_checkpoint_is_never_picked(two_step_run, tmp_path):
    """A complete-looking write that was never renamed (kill -9 before the commit) is invisible."""
    src, config = two_step_run
    wd = tmp_path / "run"
    shutil.copytree(src, wd)
    shutil.copytree(wd / "checkpoints" / "10", wd / "checkpoints" / f"15{TMP_SUFFIX}")
    shutil.copytree(wd / "checkpoints" / "10", wd / "checkpoints" / f"20{TMP_SUFFIX}")
    (wd / "checkpoints" / f"20{TMP_SUFFIX}" / "commit_success.txt").unlink()
    assert int(_latest_restore(wd, config)["step"]) == 10
    assert workdir_lib.load_run(str(wd)).step == 10


# ================================================================================================ divergence
@pytest.mark.slow
def test_nan_stops_with_the_step_and_keeps_the_last_good_checkpoint(cache_dir, tmp_path):
    wd = tmp_path / "run"
    config = tiny_config(cache_dir, 30, **{"train.learning_rate": "1e3", "train.warmup_steps": "4",
                                           "checkpoint.every": "2"})
    with pytest.raises(UserError) as info:
        pretrain_loop.pretrain(config, str(wd), devices=jax.devices()[:1])
    message = str(info.value)
    step = int(re.search(r"training diverged at step (\d+)", message).group(1))
    assert "\n" not in message and "learning_rate" in message
    kept = committed(wd)
    assert kept and max(kept) < step and not leftovers(wd)
    assert f"last good checkpoint (step {max(kept)}) is kept" in message
    params = params_of(wd)
    assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(params))
    assert committed(wd) == kept


# ================================================================================================ disk full
def test_disk_full_during_a_save_is_one_line_and_keeps_earlier_checkpoints(cache_dir, tmp_path):
    """Simulation: from the save of step 10 on, the kernel refuses to grow any file past 100 kB
    (RLIMIT_FSIZE; writes fail with EFBIG exactly like ENOSPC does on a full disk). Our code does not special-case
    the limit: the failing writes happen inside Orbax/tensorstore. SIGXFSZ is ignored so the write returns an error.
    """
    wd = tmp_path / "run"
    config = tiny_config(cache_dir, 15)
    original_save = ckpt.Checkpointer.save
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def save(self, step, *args, **kwargs):
        if step == 10:
            self.wait()
            resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
        return original_save(self, step, *args, **kwargs)

    ckpt.Checkpointer.save = save
    try:
        with pytest.raises(UserError) as info:
            pretrain_loop.pretrain(config, str(wd), devices=jax.devices()[:1])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        ckpt.Checkpointer.save = original_save
        signal.signal(signal.SIGXFSZ, old_handler)
    message = str(info.value)
    assert message.startswith("error: disk full") and "\n" not in message and "step 10" in message, message
    assert committed(wd) == [5] and not leftovers(wd)
    assert workdir_lib.load_run(str(wd)).step == 5


def test_disk_full_enospc_from_a_python_write(tmp_path, standin_model):
    """The same for ENOSPC raised by a Python-level write of the checkpoint (Orbax's JSON items)."""
    import errno  # pylint: disable=import-outside-toplevel
    from etils import epath  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    model = standin_model()
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    state = {"params": jax.tree_util.tree_map(lambda x: x, params), "step": jnp.int32(0)}
    original = epath.Path.write_text
    with ckpt.Checkpointer(str(tmp_path), every=1, keep=3, async_=True) as c:
        c.save(1, state, {"i": 1})
        c.wait()

        def full(self, *args, **kwargs):
            if "/2" + TMP_SUFFIX in str(self):
                raise OSError(errno.ENOSPC, "No space left on device", str(self))
            return original(self, *args, **kwargs)

        epath.Path.write_text = full
        try:
            with pytest.raises(UserError, match="disk full: could not write checkpoint step 2"):
                c.save(2, state, {"i": 2})
                c.wait()
        finally:
            epath.Path.write_text = original
        assert c.all_steps() == [1]
    assert not [d for d in os.listdir(tmp_path / "checkpoints") if TMP_SUFFIX in d]



def test_restore_and_data_never_unpickle(two_step_run, tmp_path, monkeypatch):
    """Restoring a checkpoint and reading the data cache work with every unpickling entry point disabled."""
    import pickle  # pylint: disable=import-outside-toplevel

    def refuse(*args, **kwargs):
        raise AssertionError("something tried to unpickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    src, config = two_step_run
    run = workdir_lib.load_run(str(src))
    assert run.step == 10
    assert int(_latest_restore(src, config)["step"]) == 10
    from tupe_jax import data as data_lib  # pylint: disable=import-outside-toplevel
    it = data_lib.pretrain_iterator(config, run.tokenizer, split="train", global_batch_size=16, seed=0)
    assert next(it).inputs.shape[0] == 16
