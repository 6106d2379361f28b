"""The bucket lease (`RunLock` on a `gs://` workdir) against the GCS emulator of gcs_fixtures: a second process is
refused, a stale lease is taken over, of two commands racing for a folder only one wins, a holder taken for dead
stops its heartbeat and its run stops before its next checkpoint, and a heartbeat rides out storage errors
(a whole run in a bucket: test_gcs.py)."""
import importlib
import json
import os
import subprocess
import sys
import threading
import time

import jax
import pytest

from tests import xla_flags
from tests.gcs_fixtures import BUCKET, ROOT, TINY, tiny
from tupe_jax import files
from tupe_jax import workdir as workdir_lib
from tupe_jax.errors import UserError
from tupe_jax.metrics import read_metrics
from tupe_jax.pretrain import loop as pretrain_loop


LEASER = r'''
import sys, time
from tupe_jax.workdir import RunLock
with RunLock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
'''


def test_the_bucket_lease_refuses_a_second_process_and_a_stale_lease_is_taken_over(gcs):
    import json  # pylint: disable=import-outside-toplevel
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    import time  # pylint: disable=import-outside-toplevel
    folder = f"gs://{BUCKET}/leased"
    holder = subprocess.Popen([sys.executable, "-c", LEASER, folder], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError) as info:
            with workdir_lib.RunLock(folder):
                pass
        assert f"is in use by process {holder.pid}" in str(info.value) and "heartbeat" in str(info.value)
        with pytest.raises(UserError, match=f"is in use by process {holder.pid}.*heartbeat"):
            workdir_lib.refuse_if_held(folder)         # the read-only check before the gate
    finally:
        holder.kill()                                  # a hard kill leaves a fresh-looking lease behind
        holder.wait()
    lease = json.loads(files.read_text(folder + "/.lock"))
    lease["heartbeat"] = time.time() - 301             # ... until it is older than LEASE_SECONDS
    files.write_text(folder + "/.lock", json.dumps(lease))
    workdir_lib.refuse_if_held(folder)                 # a stale lease is no refusal ...
    assert json.loads(files.read_text(folder + "/.lock")) == lease      # ... and the check writes nothing
    with workdir_lib.RunLock(folder) as lock:
        assert lock.taken_over and str(holder.pid) in lock.taken_over
        assert json.loads(files.read_text(folder + "/.lock"))["pid"] == os.getpid()
    assert not files.exists(folder + "/.lock")


def lose_the_race(monkeypatch, folder, other, what):
    """Our check of the folder's lease passes, then, before our conditional write, another command writes `other`:
    ours is refused naming it, and its lease is left as it is."""
    lock_module = importlib.import_module("tupe_jax.workdir.lock")
    checked = lock_module._stale_lease              # pylint: disable=protected-access

    def then_the_other_writes(workdir, path):
        found = checked(workdir, path)
        files.write_text(path, json.dumps(other))
        return found
    monkeypatch.setattr(lock_module, "_stale_lease", then_the_other_writes)
    with pytest.raises(UserError, match=f"^error: {folder} is in use by process 7 on h .*heartbeat"):
        with workdir_lib.RunLock(folder):
            pytest.fail(what)
    assert json.loads(files.read_text(folder + "/.lock")) == other


def test_of_two_commands_that_both_saw_a_bucket_folder_free_only_one_gets_the_lease(gcs, monkeypatch):
    other = {"pid": 7, "host": "h", "started": "s", "command": "c", "heartbeat": time.time()}
    lose_the_race(monkeypatch, f"gs://{BUCKET}/raced", other, "both commands hold the folder")


def test_of_two_commands_that_both_saw_the_same_stale_lease_only_one_takes_it_over(gcs, monkeypatch):
    folder = f"gs://{BUCKET}/raced-stale"
    dead = {"pid": 5, "host": "gone", "started": "s", "command": "c", "heartbeat": time.time() - 3600}
    files.write_text(folder + "/.lock", json.dumps(dead))
    other = {"pid": 7, "host": "h", "started": "s", "command": "c", "heartbeat": time.time()}
    lose_the_race(monkeypatch, folder, other, "both commands took the dead run's folder over")


def test_a_holder_taken_for_dead_stops_its_heartbeat_and_leaves_the_new_lease(gcs, monkeypatch, capsys):
    """A run that went LEASE_SECONDS without a heartbeat (a stalled VM) and was taken over: its next heartbeat is
    refused, it says so, and neither a heartbeat nor its release overwrites or deletes the new holder's lease."""
    folder = f"gs://{BUCKET}/taken-from-a-live-run"
    lock_module = importlib.import_module("tupe_jax.workdir.lock")
    monkeypatch.setattr(lock_module, "LEASE_SECONDS", 0.4)          # a heartbeat every 0.1 s
    other = {"pid": 7, "host": "h", "started": "s", "command": "c", "heartbeat": time.time()}
    with workdir_lib.RunLock(folder):
        time.sleep(0.3)                                             # our heartbeats land
        assert json.loads(files.read_text(folder + "/.lock"))["pid"] == os.getpid()
        files.write_text(folder + "/.lock", json.dumps(other))      # another command takes the folder over
        deadline = time.monotonic() + 30                            # our next heartbeat finds the lease changed
        while any(t.name == "tupe-jax-lease" for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.02)                                        # ... and its thread ends
        assert json.loads(files.read_text(folder + "/.lock")) == other
    assert json.loads(files.read_text(folder + "/.lock")) == other  # the release left it alone
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "was taken over by process 7 on h" in lines[0], lines


def test_a_run_whose_lease_was_taken_over_stops_before_its_next_checkpoint(gcs, tmp_path, monkeypatch):
    """A run taken for dead (a stalled VM) that trains on: before its next checkpoint it reads the lease, finds it
    another's (long before its heartbeat thread would look) and stops with one line. It writes no checkpoint after
    the takeover, leaves the new holder's lease alone and removes nothing from the folder, now the other's."""
    from tupe_jax import metrics as metrics_lib  # pylint: disable=import-outside-toplevel
    monkeypatch.chdir(tmp_path)
    remote = f"gs://{BUCKET}/taken-mid-run"
    other = {"pid": 7, "host": "h", "started": "s", "command": "c", "heartbeat": time.time()}
    write = metrics_lib.MetricsWriter.write

    def taken_over_after_step_2(self, step, values):
        write(self, step, values)
        if step == 2:                                        # another command takes the folder over mid-run
            files.write_text(remote + "/.lock", json.dumps(other))
    monkeypatch.setattr(metrics_lib.MetricsWriter, "write", taken_over_after_step_2)
    with pytest.raises(workdir_lib.LeaseLost) as caught:
        pretrain_loop.pretrain(tiny(tmp_path / "cache"), remote, devices=jax.devices()[:1])
    assert str(caught.value).startswith(f"error: this run's lease on {remote} was taken over by process 7 on h")
    assert "\n" not in str(caught.value)
    assert workdir_lib.checkpoint_steps(remote) == []               # step 3's checkpoint was not written
    assert json.loads(files.read_text(remote + "/.lock")) == other  # the release left the new lease alone
    assert {"config.json", "tokenizer"} <= set(files.listdir(remote))   # a failed run's cleanup did not run


def test_metrics_stop_reaching_a_bucket_folder_the_run_no_longer_holds(gcs, capsys):
    """A bucket's metrics.jsonl is rewritten whole at each flush: once the run's lease is another launch's
    (`owns_folder` False), the writer drops its rows with one line and neither rewrites that launch's metrics nor
    uploads TensorBoard events."""
    from tupe_jax.metrics import MetricsWriter  # pylint: disable=import-outside-toplevel
    folder = f"gs://{BUCKET}/metrics-after-takeover"
    ours = [True]
    writer = MetricsWriter(folder, enabled=True, flush_secs=0, owns_folder=lambda: ours[0])
    writer.write(1, {"loss": 1.0})
    assert [r["step"] for r in read_metrics(folder)] == [1]
    theirs = json.dumps({"step": 9, "loss": 0.5}) + "\n"
    files.write_text(folder + "/metrics.jsonl", theirs)               # the new holder's metrics
    ours[0] = False
    writer.write(2, {"loss": 0.9})
    writer.flush()
    writer.write(3, {"loss": 0.8})
    writer.close()
    assert files.read_text(folder + "/metrics.jsonl") == theirs
    assert not files.exists(folder + "/tensorboard")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "this run no longer holds its folder" in lines[0], lines


def beat_through(monkeypatch, folder, second_write):
    """Hold `folder` with 0.4-s leases until four writes (up to 30 s; under load a fixed 0.5 s saw 2 or 3), the
    second write of the lease (its first renewal; the creation is the first) going through `second_write(write, path,
    text, generation)`: the renewals went on after it, the lease stayed ours and was released."""
    lock_module = importlib.import_module("tupe_jax.workdir.lock")
    monkeypatch.setattr(lock_module, "LEASE_SECONDS", 0.4)
    write_object, calls = files.write_object, []

    def write(path, text, generation):
        calls.append(text)
        if len(calls) == 2:
            return second_write(write_object, path, text, generation)
        return write_object(path, text, generation)
    monkeypatch.setattr(files, "write_object", write)
    with workdir_lib.RunLock(folder):
        deadline = time.monotonic() + 30                            # a loaded machine renews later, not never
        while len(calls) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(calls) >= 4                                      # it went on renewing after the second write
        assert json.loads(files.read_text(folder + "/.lock"))["pid"] == os.getpid()
    assert not files.exists(folder + "/.lock")                      # and released its own lease


def test_a_heartbeat_that_meets_a_storage_error_tries_again(gcs, monkeypatch, capsys):
    """A renewal that fails (the endpoint unreachable past the client's retries) is reported and retried at the
    next beat: a heartbeat thread that died would let the lease expire under a live run."""
    def fails(write, path, text, generation):
        raise ConnectionError("connection reset by peer")
    beat_through(monkeypatch, f"gs://{BUCKET}/flaky-endpoint", fails)
    err = capsys.readouterr().err
    assert "renewing the lease failed (ConnectionError: connection reset by peer)" in err and "error:" not in err


def test_a_heartbeat_whose_reply_was_lost_keeps_the_lease(gcs, monkeypatch, capsys):
    """A heartbeat upload that landed but whose reply was lost is retried by the client and refused (the lease is
    no longer at the generation it was conditioned on): the holder finds its own text there and keeps beating."""
    def lands_but_loses_its_reply(write, path, text, generation):
        write(path, text, generation)
        raise FileExistsError(path)
    beat_through(monkeypatch, f"gs://{BUCKET}/lost-reply", lands_but_loses_its_reply)
    assert "error:" not in capsys.readouterr().err


def test_a_run_whose_lease_object_is_gone_says_so(gcs, tmp_path, monkeypatch):
    """The lease object deleted under a live run (its folder or bucket deleted): the run stops before its next
    checkpoint saying the lease is gone, not that another process took it over (there is none)."""
    from tupe_jax import metrics as metrics_lib  # pylint: disable=import-outside-toplevel
    monkeypatch.chdir(tmp_path)
    remote = f"gs://{BUCKET}/lease-deleted-mid-run"
    write = metrics_lib.MetricsWriter.write

    def deleted_after_step_2(self, step, values):
        write(self, step, values)
        if step == 2:
            files.remove(remote + "/.lock")
    monkeypatch.setattr(metrics_lib.MetricsWriter, "write", deleted_after_step_2)
    with pytest.raises(workdir_lib.LeaseLost) as caught:
        pretrain_loop.pretrain(tiny(tmp_path / "cache"), remote, devices=jax.devices()[:1])
    assert str(caught.value).startswith(f"error: this run's lease object {remote}/.lock is gone (the run folder or "
                                        "its bucket was deleted")
    assert "taken over" not in str(caught.value) and "\n" not in str(caught.value)


SETUP_STOPPED = r'''
import os, signal, sys
import launch
from tupe_jax import data
real = data.get_tokenizer
def get_tokenizer(*a, **k):      # a SIGTERM (a preempted VM's notice) while the setup builds the tokenizer
    os.kill(os.getpid(), signal.SIGTERM)
    return real(*a, **k)
data.get_tokenizer = get_tokenizer
sys.exit(launch.main(sys.argv[1:]))
'''


def test_a_sigterm_during_the_setup_exits_0_and_releases_the_lease(gcs, tmp_path):
    """SIGTERM before the loop's Trainer was built had its default action (rc -15): nothing ran its `finally`, and
    the lease it left in the bucket refused the relaunch for up to 300 s. It stops before the first step, as a
    preemption before the first checkpoint does, and the relaunch trains the run."""
    wd = f"gs://{BUCKET}/stopped-in-setup"
    argv = ["pretrain", "--config=configs/pretrain.py:pe=tupe_r", f"--workdir={wd}",
            f"--config.data.cache_dir={tmp_path / 'cache'}", *[f"--config.{k}={v}" for k, v in TINY.items()]]
    env = dict(os.environ, XLA_FLAGS=xla_flags.devices(1), PYTHONPATH=ROOT)
    first = subprocess.run([sys.executable, "-c", SETUP_STOPPED, *argv], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300, check=False)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "preemption before this process's first step: nothing saved; a rerun starts from the beginning" in \
        first.stdout
    assert files.read_object(f"{wd}/.lock") == ("", 0) and not files.exists(f"{wd}/checkpoints/3")
    again = subprocess.run([sys.executable, "-m", "launch", *argv], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300, check=False)
    assert again.returncode == 0, again.stderr[-2000:]
    assert workdir_lib.checkpoint_steps(wd) == [3, 6]
