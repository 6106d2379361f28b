"""Two real JAX processes (jax.distributed, gloo) on one prepared directory: disjoint rows whose union is the
single-process global batch bitwise, and a kill -9 of both + resume that continues exactly (the first run
started staggered, process 1 only once process 0 waits for it)."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import launch
from test_data_prepare import prepare_args, write_corpus
from test_multiprocess import ROOT, env, free_port
from tupe_jax.metrics import read_metrics

# a child process: join the 2-process job, build this process's iterator (process index/count from JAX), save it
CHILD = r"""
import sys, jax, numpy as np, ml_collections
port, pid, out, folder = sys.argv[1:5]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=int(pid))
from tupe_jax import data as D
c = ml_collections.ConfigDict({"data": D.default_data_config(),
                               "model": {"vocab_size": 200, "max_len": 32, "objective": "mlm"}})
c.data.name, c.data.path, c.data.prefetch = "prepared", folder, 0   # no read-ahead: count reads per batch
it = D.pretrain_iterator(c, D.get_tokenizer(c, None), split="train", global_batch_size=8, seed=5)
it.batcher.source.reads = []
batches = [next(it).present() for _ in range(4)]
np.savez(out, reads=np.asarray(it.batcher.source.reads), rows=np.concatenate(
    [it.batcher.examples(s)[0] for s in range(4)]), **{f"{k}{s}": v for s, b in enumerate(batches) for k, v in b.items()})
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mp")
    corpus = write_corpus(tmp / "corpus", docs=400)
    assert launch.main(prepare_args(corpus, tmp / "prepared")) == 0
    return tmp / "prepared"


@pytest.mark.slow
def test_two_gloo_processes_read_disjoint_rows_whose_union_is_the_global_batch(folder, tmp_path):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(port), str(i), str(tmp_path / f"p{i}.npz"),
                               str(folder)], cwd=ROOT, env=env(1), stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()[-3000:]
    got = [np.load(tmp_path / f"p{i}.npz") for i in range(2)]
    assert not set(got[0]["rows"].tolist()) & set(got[1]["rows"].tolist())          # disjoint rows
    for g in got:                                                               # each read only its own rows
        assert sorted(g["reads"].tolist()) == sorted(g["rows"].tolist())
    import ml_collections
    from tupe_jax import data as D
    c = ml_collections.ConfigDict({"data": D.default_data_config(),
                                   "model": {"vocab_size": 200, "max_len": 32, "objective": "mlm"}})
    c.data.name, c.data.path = "prepared", str(folder)
    whole = D.pretrain_iterator(c, D.get_tokenizer(c, None), split="train", global_batch_size=8, seed=5,
                                process_index=0, process_count=1)
    for s in range(4):
        b = next(whole).present()
        for k, v in b.items():
            union = np.empty_like(v)
            union[0::2], union[1::2] = got[0][f"{k}{s}"], got[1][f"{k}{s}"]
            np.testing.assert_array_equal(union, v, err_msg=f"{k} step {s}")


def pretrain_cmd(workdir, folder, port=None, pid=None, steps=24):
    cmd = [sys.executable, "-m", "launch", "pretrain", "--config=configs/pretrain.py:pe=tupe_r", f"--workdir={workdir}",
           "--config.data.name=prepared", f"--config.data.path={folder}", "--config.model.vocab_size=200",
           "--config.model.max_len=32", "--config.model.hidden_size=32", "--config.model.num_heads=2",
           "--config.model.mlp_dim=64", f"--config.train.steps={steps}", "--config.train.batch_size=8",
           "--config.train.log_every=1", "--config.train.eval_every=0", "--config.checkpoint.every=2",
           "--config.checkpoint.keep=100", "--config.checkpoint.async_save=false",
           "--config.model.dropout_rate=0.0", "--config.model.attention_dropout_rate=0.0"]
    if port is not None:
        cmd += [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={pid}"]
    return cmd


# process 1 of a staggered run, as a host that boots late on a pod: `python -m launch` whose workdir checks begin
# only once process 0 is past its own (waiting for process 1, or — were it not to wait — creating `checkpoints/`)
LATE = r"""
import importlib, os, runpy, time
claim = importlib.import_module("tupe_jax.workdir.claim")   # the module (the package exports the function)
checks, log = claim.check_config, os.environ["STAGGER_LOG"]
def late(workdir, *args, **kwargs):
    deadline = time.time() + 300
    while time.time() < deadline and not os.path.exists(os.path.join(workdir, "checkpoints")) and \
            "waiting for the other processes" not in open(log, encoding="utf-8").read():
        time.sleep(0.05)
    return checks(workdir, *args, **kwargs)
claim.check_config = late
runpy.run_module("launch", run_name="__main__", alter_sys=True)
"""


def two_processes(workdir, folder, stagger_log=None):
    """The two processes of one run; with `stagger_log` (a file for process 0's stdout) process 1 is `LATE`. The
    folder must not change under a late process's checks: Orbax's reads there are collective, and are made only
    when `checkpoints/` exists."""
    port = free_port()
    procs = []
    for i in range(2):
        cmd, out, extra = pretrain_cmd(workdir, folder, port, i), subprocess.PIPE, {}
        if stagger_log and i == 0:
            out = open(stagger_log, "w", encoding="utf-8")   # pylint: disable=consider-using-with
        elif stagger_log:
            cmd, extra = [sys.executable, "-c", LATE] + cmd[3:], {"STAGGER_LOG": str(stagger_log)}
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**env(2), **extra}, stdout=out, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
        if out is not subprocess.PIPE:
            out.close()
    return procs


def losses(workdir):
    out = {}
    for m in read_metrics(str(workdir)):
        if "loss" in m:
            out[m["step"]] = m["loss"]   # a resumed run logs the redone steps again: the last one counts
    return out


def finish(procs):
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]


@pytest.mark.slow
def test_two_processes_kill_9_and_resume_continue_exactly(folder, tmp_path):
    finish(two_processes(tmp_path / "straight", folder, stagger_log=tmp_path / "straight0.out"))
    assert "waiting for the other processes" in (tmp_path / "straight0.out").read_text(encoding="utf-8")
    procs = two_processes(tmp_path / "killed", folder)
    ckpt = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 600
    while time.time() < deadline and not (ckpt.is_dir() and any(d.isdigit() and int(d) >= 4 for d in
                                                                 os.listdir(ckpt))):
        ended = [p for p in procs if p.poll() is not None]
        assert not ended, f"a process ended (exit {ended[0].returncode}) before it could be killed: " + \
            ended[0].communicate()[1][-3000:]
        time.sleep(0.05)
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    steps = sorted(int(d) for d in os.listdir(ckpt) if d.isdigit())
    assert steps and steps[-1] < 24, steps
    finish(two_processes(tmp_path / "killed", folder))
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "killed")
    assert sorted(a) == sorted(b) == list(range(1, 25))
    assert a == b, json.dumps({s: (a[s], b[s]) for s in a if a[s] != b[s]})
