"""Two real JAX processes (jax.distributed on 127.0.0.1, gloo CPU collectives, 2 fake devices each) train the
same 5 steps as one process with 4 devices, evaluate a run and fine-tune from one as one process does, through the
launcher."""
import json
import os
import random
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests import xla_flags
from tests.workdir_fixtures import LOCKER, tree
from tupe_jax.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = {"model.hidden_size": 32, "model.num_layers": 2, "model.num_heads": 2, "model.mlp_dim": 64,
             "model.vocab_size": 512, "model.max_len": 32, "train.steps": 5, "train.batch_size": 16,
             "train.learning_rate": "3e-3", "train.warmup_steps": 2, "train.log_every": 1, "train.eval_every": 0,
             "checkpoint.every": 1000, "checkpoint.async_save": "false",
             # dropout masks follow a row's place in the global array, which differs between the two layouts
             "model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0}


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux; IANA's range elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="utf-8") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def free_port() -> int:
    """A free port for a coordinator, below the ephemeral range: an outgoing connection of any process (the
    collectives' own, the storage emulator's) never takes it between this check and the coordinator's bind, as
    it could take a port the kernel handed out for port 0. The two xdist workers draw from halves of the range."""
    low = 10000
    high = min(ephemeral_ports()[0], 1 << 16) - 1
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    half = (high - low) // 2
    start = low + (half if worker.isdigit() and int(worker) % 2 else 0)
    for port in random.Random().sample(range(start, start + half), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}..{start + half - 1}")


def command(workdir, cache_dir, extra=()):
    """The pretrain command line; an override in `extra` replaces the default one (a key may be given once)."""
    given = {a.split("=", 1)[0] for a in extra}
    return [sys.executable, "-m", "launch", "pretrain", "--config=configs/pretrain.py:pe=tupe_r",
            f"--workdir={workdir}", f"--config.data.cache_dir={cache_dir}"] + \
        [f"--config.{k}={v}" for k, v in OVERRIDES.items() if f"--config.{k}" not in given] + list(extra)


def env(devices):
    return {**os.environ, "XLA_FLAGS": xla_flags.devices(devices), "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
            "JAX_PLATFORMS": "cpu"}


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    cache = tmp_path / "cache"
    single = subprocess.run(command(tmp_path / "single", cache), cwd=ROOT, env=env(4), capture_output=True,
                            text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    port = free_port()
    procs = [subprocess.Popen(command(tmp_path / "multi", cache,
                                      [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                                       f"--process_id={i}"]),
                              cwd=ROOT, env=env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    one = [m["loss"] for m in read_metrics(str(tmp_path / "single")) if "loss" in m]
    two = [m["loss"] for m in read_metrics(str(tmp_path / "multi")) if "loss" in m]
    assert len(one) == len(two) == 5
    np.testing.assert_allclose(two, one, atol=1e-5, rtol=0)
    assert sorted(os.listdir(tmp_path / "multi" / "checkpoints"))[-1] == "5"


@pytest.mark.slow
def test_a_folder_locked_for_process_0_stops_both_processes_with_its_line(tmp_path):
    """Only process 0 checks the lock; process 1 must not be left waiting for it at a collective call."""
    wd = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", LOCKER, str(wd), "600"], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    procs = []
    try:
        assert holder.stdout.readline().strip() == "locked"
        before, port = tree(wd), free_port()
        procs = [subprocess.Popen(command(wd, tmp_path / "cache", [f"--coordinator_address=127.0.0.1:{port}",
                                                                   "--num_processes=2", f"--process_id={i}"]),
                                  cwd=ROOT, env=env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(2)]
        outs = [p.communicate(timeout=180) for p in procs]
        lines = [(err.strip().splitlines() or [""])[-1] for _, err in outs]
        assert [p.returncode for p in procs] == [2, 2], lines
        assert f"is in use by process {holder.pid} on" in lines[0] and lines[0].startswith("error: ")
        assert lines[1].replace(" (found by process 0; this is process 1)", "", 1) == lines[0] != lines[1]
        assert tree(wd) == before
    finally:
        for p in procs + [holder]:
            p.kill()
            p.wait()
        holder.stdout.close()


def two_processes(argv, environment, timeout=300, code=0, each=lambda i: (), cwd=lambda i: ROOT):
    """`python -m launch *argv *each(i)` as processes i = 0 and 1 of one jax.distributed job, in folder `cwd(i)`;
    their (stdout, stderr), each process checked to exit with `code`."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "launch", *argv, *each(i),
                               f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}"],
                              cwd=cwd(i), env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == code, err[-3000:]
    return outs


@pytest.mark.slow
def test_two_processes_evaluate_a_run_as_one_process_does(tmp_path):
    """`launch evaluate` on every host of a pod: each process restores the params onto its own device and the
    evaluation replicates them across hosts. It restored onto process 0's device before, which process 1 cannot
    address: process 1 failed and process 0 hung at the next collective."""
    from tests.glue_fixtures import make_pretrained
    from tupe_jax.pretrain.evaluate import evaluate
    make_pretrained(tmp_path / "run", tmp_path / "cache")
    outs = two_processes(["evaluate", f"--workdir={tmp_path / 'run'}"],
                         {**env(2), "TUPE_JAX_CACHE": str(tmp_path / "cache")}, timeout=240)
    rows = [m for m in read_metrics(str(tmp_path / "run")) if m.get("split") == "validation"]
    assert len(rows) == 1                                    # one row, written by process 0
    alone = evaluate(str(tmp_path / "run"))
    assert rows[0]["eval_loss"] == pytest.approx(alone["eval_loss"], abs=1e-5)
    assert rows[0]["eval_mlm_accuracy"] == pytest.approx(alone["eval_mlm_accuracy"], abs=1e-6)
    assert all(f"step 10: eval_loss {alone['eval_loss']:.4f}" in out for out, _ in outs)


@pytest.mark.slow
def test_two_processes_fine_tune_from_a_run_as_one_process_does_from_a_cold_cache(tmp_path):
    """GLUE on several processes sharing a cold data cache: one prepares the task's data while the other waits on
    the lock (a builder made before the data was complete held no splits: that process stopped, the other hung);
    both read the init_from step process 0 chose; the scores and losses equal one process's."""
    from tests.glue_fixtures import make_pretrained, write_glue_dir
    make_pretrained(tmp_path / "pre", tmp_path / "cache0")
    write_glue_dir(str(tmp_path / "glue"), {"rte": (64, 16, 8)})
    args = ["finetune", "--config=configs/glue.py:task=rte,pe=tupe_r,size=tiny",
            f"--config.init_from={tmp_path / 'pre'}", f"--config.data.glue_dir={tmp_path / 'glue'}",
            "--config.model.hidden_size=32", "--config.model.num_heads=2", "--config.model.mlp_dim=64",
            "--config.model.vocab_size=512", "--config.model.max_len=64", "--config.model.dropout_rate=0",
            "--config.model.attention_dropout_rate=0", "--config.train.steps=4", "--config.train.batch_size=16",
            "--config.train.eval_batch_size=16", "--config.train.log_every=1", "--config.checkpoint.async_save=false",
            "--config.data.glue_buckets=(64,)"]
    two_processes([*args, f"--workdir={tmp_path / 'two'}", f"--config.data.cache_dir={tmp_path / 'cache2'}"], env(2))
    one = subprocess.run([sys.executable, "-m", "launch", *args, f"--workdir={tmp_path / 'one'}",
                          f"--config.data.cache_dir={tmp_path / 'cache1'}"], cwd=ROOT, env=env(4),
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    two_results, one_results = (json.loads((tmp_path / w / "results.json").read_text()) for w in ("two", "one"))
    assert two_results["init_step"] == one_results["init_step"] == 10
    assert two_results["final"]["metrics"] == pytest.approx(one_results["final"]["metrics"], abs=1e-6)
    losses = [[m["loss"] for m in read_metrics(str(tmp_path / w)) if "loss" in m] for w in ("two", "one")]
    assert len(losses[0]) == len(losses[1]) == 4
    np.testing.assert_allclose(losses[0], losses[1], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_two_processes_export_a_run_once(tmp_path):
    """`launch export` on every host of a pod, into one folder: process 0 writes it, the other only reads the
    checkpoint with it (two writers raced: a rename onto the folder the other made, or uploads of the same objects).
    The folder equals a one-process export's; a second export into it is refused on both processes alike."""
    from tests.glue_fixtures import make_pretrained
    from tupe_jax.interop.export import export
    make_pretrained(tmp_path / "run", tmp_path / "cache")
    environment = {**env(2), "TUPE_JAX_CACHE": str(tmp_path / "cache")}
    outs = two_processes(["export", f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'two'}"], environment)
    assert "exported" in outs[0][0] and "is written by process 0" in outs[1][0]
    export(str(tmp_path / "run"), str(tmp_path / "one"))
    assert sorted(os.listdir(tmp_path / "two")) == sorted(os.listdir(tmp_path / "one"))
    for name in os.listdir(tmp_path / "one"):     # byte for byte (README.md names its folder)
        one = (tmp_path / "one" / name).read_bytes()
        assert (tmp_path / "two" / name).read_bytes() == (
            one.replace(b"=one", b"=two").replace(b"runs/one", b"runs/two") if name == "README.md" else one), name
    again = two_processes(["export", f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'two'}"], environment,
                          code=2)
    assert all(err.strip().splitlines()[-1].startswith(f"error: {tmp_path / 'two'} already exists") for _, err in again)


def sigterm_process_1(procs):
    """A preemption notice to process 1 alone; both processes' (stdout, stderr), each checked to exit 0 (the
    caller kills them on its way out, whatever happened)."""
    procs[1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    return outs


@pytest.mark.slow
def test_a_sigterm_to_one_process_saves_one_step_on_both(tmp_path):
    """A preemption notice that reaches one host of a pod: our own SIGTERM handler replaced JAX's preemption notifier,
    so only that process stopped (at a save the other never joined: it crashed at its next collective, and no
    checkpoint was written). Now JAX tells every process, and both save the same step and exit 0."""
    import time
    wd = tmp_path / "run"
    port = free_port()
    procs = [subprocess.Popen(command(wd, tmp_path / "cache", [f"--coordinator_address=127.0.0.1:{port}",
                                                                "--num_processes=2", f"--process_id={i}",
                                                                "--config.train.steps=100000"]),
                              cwd=ROOT, env=env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            rows = read_metrics(str(wd)) if (wd / "metrics.jsonl").exists() else []
            if sum("loss" in r for r in rows) >= 3:        # past the first step (its compile) on both processes
                break
            time.sleep(0.5)
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
        outs = sigterm_process_1(procs)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    saved = [[line for line in out.splitlines() if line.startswith("preemption: saved step ")] for out, _ in outs]
    assert len(saved[0]) == 1 and saved[0] == saved[1], saved
    step = int(saved[0][0].split()[3])
    assert os.listdir(wd / "checkpoints") == [str(step)] and step < 100000


@pytest.mark.slow
def test_a_sigterm_while_a_resumed_run_compiles_stops_both_processes(tmp_path):
    """JAX's sync point is one past the largest step reported; a notice before the first report (a resume's
    restore or compile) put it at 1, while the loop asked about the run's steps S+1, S+2, ...: the run trained on
    until the preemption killed it. The loop now reports its own count of steps: it stops (nothing saved at the
    first step, else one step saved by both)."""
    import time
    wd, cache = tmp_path / "run", tmp_path / "cache"

    def launch_both(extra):
        port = free_port()
        return [subprocess.Popen(command(wd, cache, [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                                                     f"--process_id={i}", *extra]),
                                 cwd=ROOT, env=env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for i in range(2)]

    for p in launch_both([]):                           # 5 steps, checkpoint 5
        assert p.wait(timeout=300) == 0, p.stderr.read()[-2000:]
    procs = launch_both(["--config.train.steps=100000", "--config.train.decay_steps=5"])
    try:
        seen, deadline = [], time.monotonic() + 240
        while time.monotonic() < deadline:
            line = procs[0].stdout.readline()
            seen.append(line)
            if not line or line.startswith("resumed from step 5"):
                break
        assert seen[-1].startswith("resumed from step 5"), (seen, procs[0].stderr.read()[-3000:])
        outs = sigterm_process_1(procs)                  # while the first step compiles (or just after it)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    ends = [[ln for ln in out.splitlines() if ln.startswith(("preemption", "interrupted"))] for out, _ in outs]
    assert ends[0] == ends[1] and len(ends[0]) == 1, ends
    assert ends[0][0].startswith(("preemption during this process's first step: nothing saved",
                                  "preemption: saved step "))


@pytest.mark.slow
def test_a_run_of_two_processes_resumes_on_one_as_if_it_had_run_there(tmp_path):
    """A checkpoint saved by two processes resumes on one (a pod of another size): the steps after it read the
    examples they would have, and (without dropout, whose masks follow a row's place) the losses are the
    uninterrupted one-process run's. It was refused ("a run with 2 processes")."""
    cache, schedule = tmp_path / "cache", ["--config.train.decay_steps=6"]
    run = subprocess.run(command(tmp_path / "single", cache, schedule + ["--config.train.steps=6"]), cwd=ROOT,
                         env=env(4), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    two_processes(command(tmp_path / "moved", cache, schedule + ["--config.train.steps=3"])[3:], env(2))
    run = subprocess.run(command(tmp_path / "moved", cache, schedule + ["--config.train.steps=6"]), cwd=ROOT,
                         env=env(4), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "the checkpoint was saved by 2 processes, this run has 1 process" in run.stderr + run.stdout
    events = [m for m in read_metrics(str(tmp_path / "moved"), raw=True) if m.get("event") == "resumed"]
    assert events == [{"step": 3, "event": "resumed", "process_count_before": 2, "process_count": 1}]
    one = {m["step"]: m["loss"] for m in read_metrics(str(tmp_path / "single")) if "loss" in m}
    moved = {m["step"]: m["loss"] for m in read_metrics(str(tmp_path / "moved")) if "loss" in m}
    assert sorted(one) == sorted(moved) == list(range(1, 7))
    np.testing.assert_allclose([moved[s] for s in one], [one[s] for s in one], atol=1e-5, rtol=0)
