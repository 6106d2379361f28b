"""Reliability (issue #8): kill -9 / SIGTERM / corrupt checkpoints / divergence / disk full / no pickle, no network.

Subprocess runs use ONE CPU device (XLA_FLAGS in their env) to stay fast; the reference run is a subprocess with the
same flags, so "bitwise equal" compares like with like. Interruptions are made deterministic by a small hook the
child installs before training (see CHILD): it sends itself SIGKILL (a real kill -9) or SIGTERM at a chosen point.
"""
from __future__ import annotations

import glob
import io
import json
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
import tokenize

import jax
import numpy as np
import pytest

from configs import pretrain as pretrain_config
from tests import xla_flags
from tupe_jax import checkpoint as ckpt
from tupe_jax import config as config_lib
from tupe_jax import trainer as trainer_lib
from tupe_jax import workdir as workdir_lib
from tupe_jax.model import ModelConfig, TransformerLM
from tupe_jax.pretrain import loop as pretrain_loop
from tupe_jax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TMP_SUFFIX = ".orbax-checkpoint-tmp"

# The child: train the workdir's config.json; KILL = {"phase": ..., ...} picks where it interrupts itself:
#   step   SIGKILL at the start of the `calls`-th step of this invocation (between checkpoints)
#   save   SIGKILL right after the asynchronous save of `step` was started (its files are being written)
#   commit SIGKILL when the save of `step` has written everything and is about to rename (commit) it
#   term   SIGTERM at the start of the `calls`-th step (graceful: save the current step, exit 0)
CHILD = r'''
import json, os, signal, sys, time
import tupe_jax.sharding as sh
from tupe_jax import checkpoint as ckpt, workdir
from tupe_jax.pretrain import loop
wd, kill = sys.argv[1], json.loads(os.environ.get("KILL", "null"))
def hit(sig):
    with open(os.path.join(wd, "interrupted_at"), "w") as f:
        f.write(str(time.time()))
    os.kill(os.getpid(), sig)
if kill and kill["phase"] in ("step", "term"):
    original, calls = sh.global_batch, [0]
    def global_batch(*a, **k):
        calls[0] += 1
        if calls[0] == kill["calls"]:
            hit(signal.SIGKILL if kill["phase"] == "step" else signal.SIGTERM)
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
loop.pretrain(workdir.read_config(wd), wd)
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


# ================================================================================================ kill -9 / SIGTERM
@pytest.mark.slow
def test_kill9_at_random_steps_and_sigterm_resume_bitwise(cache_dir, tmp_path):
    steps, every = 30, 5
    config = tiny_config(cache_dir, steps)
    ref, run = tmp_path / "uninterrupted", tmp_path / "interrupted"
    for wd in (ref, run):
        workdir_lib.write_config(str(wd), config)
    result = run_child(ref)
    assert result.returncode == 0, result.stderr[-3000:]

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
    config = tiny_config(config.data.cache_dir, 15, **{"checkpoint.async_save": "false"})
    with caplog.at_level(logging.WARNING):
        pretrain_loop.pretrain(config, str(wd), devices=jax.devices()[:1])
    assert "checkpoint step 10" in caplog.text
    assert committed(wd) == [5, 10, 15]
    aside = glob.glob(str(wd / "checkpoints" / "10.bad-*"))
    assert len(aside) == 1
    assert os.path.isfile(damaged.replace(str(wd / "checkpoints" / "10"), aside[0]))
    assert workdir_lib.load_run(str(wd)).step == 15


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


# ================================================================================================ security
def pickle_uses(source: str) -> list[int]:
    """Lines of `source` whose CODE (not strings or comments) names an unpickling module or call."""
    names = {"pickle", "cPickle", "cloudpickle", "dill", "joblib", "marshal", "shelve", "eval"}
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type not in (tokenize.STRING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE)]
    hits = set()
    for i, tok in enumerate(tokens):
        text = " ".join(t.string for t in tokens[i:i + 4])
        attribute = i > 0 and tokens[i - 1].string == "."          # config.eval.lengths is not eval()
        named = tok.string in names and not attribute and (tok.string != "eval" or text.startswith("eval ("))
        call = " ".join(t.string for t in tokens[i:i + 40]).split(")")[0]     # up to the call's first ')'
        weights_only = re.match(r"torch \. load\b", text) and "weights_only = True" in call
        if tok.type == tokenize.NAME and not weights_only and (named or re.match(r"(torch|yaml) \. load\b", text)
                                                               or re.match(r"allow_pickle = True", text)):
            hits.add(tok.start[0])
    return sorted(hits)


def test_no_pickle_in_the_package():
    """Checkpoints, data and configs never go through pickle (or anything that unpickles); words in messages and
    docstrings (e.g. refusing a pickle by name) are fine. The one exception is PyTorch's restricted unpickler,
    `torch.load(..., weights_only=True)` (tensors, containers and an explicit allowlist; import-fairseq reads the
    authors' .pt with it and tests/test_interop_fairseq.py proves a crafted pickle is refused unrun)."""
    offenders = []
    for folder in ("tupe_jax", "launch", "configs"):
        for path in glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True):
            with open(path, encoding="utf-8") as f:
                offenders += [f"{os.path.relpath(path, ROOT)}:{n}" for n in pickle_uses(f.read())]
    assert not offenders, offenders
    # the scanner sees code and only code
    assert pickle_uses("import pickle\nx = torch.load(f)\nnp.load(p, allow_pickle=True)\ny = eval(s)\n") == [1, 2, 3, 4]
    assert pickle_uses("n = config.eval.lengths\n") == []
    assert pickle_uses("obj = torch.load(path, map_location='cpu', weights_only=True)\n") == []
    assert pickle_uses("obj = torch.load(path, weights_only=False)\nz = torch.load(open(p), map_location=f(x))\n") \
        == [1, 2]
    assert pickle_uses('"""refuses a pickle"""\nmsg = "pytorch_model.bin is a pickle"  # not pickle.load\n') == []


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


def test_config_files_run_only_from_the_path_given(tmp_path, monkeypatch):
    """load_config executes exactly the file passed; a run's workdir config is JSON (never executed)."""
    marker = tmp_path / "executed"
    code = f"open({str(marker)!r}, 'w').write('x')\nraise SystemExit('must not run')\n"
    # a config.py in the cwd, on sys.path and inside the workdir: none of them is ever executed
    (tmp_path / "config.py").write_text(code)
    wd = tmp_path / "run"
    wd.mkdir()
    (wd / "config.py").write_text(code)
    (wd / "config.json").write_text(json.dumps({"model": {}}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match="does not exist"):
        config_lib.load_config("configs/pretrain.py:pe=rope")           # relative to the cwd, no search path
    assert workdir_lib.read_config(str(wd)).to_dict() == {"model": {}}
    assert not marker.exists()
    good = tmp_path / "mine.py"
    good.write_text("import ml_collections\ndef get_config(arg):\n    return ml_collections.ConfigDict({'a': 1})\n")
    assert config_lib.load_config(f"{good}:x").a == 1


NO_NETWORK = '''
import socket
def _refuse(*args, **kwargs):
    raise OSError("network access attempted at run time (sockets are disabled in this test)")
socket.socket.connect = _refuse
socket.socket.connect_ex = _refuse
socket.socket.sendto = _refuse
socket.create_connection = _refuse
socket.getaddrinfo = _refuse
socket.gethostbyname = _refuse
'''


@pytest.mark.slow
def test_demo_pipeline_runs_without_network(tmp_path):
    """pretrain (building the embedded corpus and the tokenizer from scratch) + evaluate, with sockets disabled."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_NETWORK)
    wd, cache = tmp_path / "run", tmp_path / "fresh_cache"
    overrides = ["--config.model.hidden_size=32", "--config.model.num_layers=2", "--config.model.num_heads=2",
                 "--config.model.mlp_dim=64", "--config.model.vocab_size=512", "--config.model.max_len=32",
                 "--config.train.steps=4", "--config.train.batch_size=16", "--config.train.eval_every=0",
                 "--config.checkpoint.every=2", "--config.train.log_every=1"]
    code = ("import socket, sys, launch\n"
            "try:\n    socket.getaddrinfo('example.com', 80)\nexcept OSError:\n    pass\n"
            "else:\n    sys.exit('sockets are not disabled')\n"
            f"rc = launch.main(['pretrain', '--config=configs/pretrain.py:pe=tupe_r', '--workdir={wd}'] + {overrides!r})"
            f"\nrc = rc or launch.main(['evaluate', '--workdir={wd}'])\nsys.exit(rc)\n")
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}", TUPE_JAX_CACHE=str(cache),
               XLA_FLAGS=xla_flags.devices(1), NO_PROXY="*")
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        env.pop(key, None)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "network access attempted" not in result.stderr
    assert committed(wd) == [2, 4]
    assert "eval_loss" in result.stdout
