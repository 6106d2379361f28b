"""One run per folder: the lock (a second process is refused with one line before the gate reads anything, a
dead holder's lock is taken over, kill -9 then resume), the bucket lease's torn reads, and its generation
preconditions (against an in-memory bucket: the emulator ignores them on delete)."""
import fcntl
import json
import os
import signal
import subprocess
import sys

import jax
import pytest

from tupe_jax import workdir as workdir_lib
from tupe_jax.errors import UserError
from tupe_jax.workdir.undo import Before
from tests.workdir_fixtures import LOCKER, ROOT, load_config, tree
from tests import xla_flags


def test_one_process_per_folder_and_a_dead_holders_lock_is_taken_over(tmp_path, monkeypatch):
    wd = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", LOCKER, wd, "60"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError) as info:
            with workdir_lib.RunLock(wd):
                pass
        message = str(info.value)
        assert f"is in use by process {holder.pid} on" in message and "--workdir" in message and "\n" not in message
        before = tree(wd)
        with pytest.raises(UserError) as early:                             # the read-only check says the same
            workdir_lib.refuse_if_held(wd)
        assert str(early.value) == message

        def gate(*args, **kwargs):                                          # a live run prunes its checkpoints:
            raise AssertionError("the gate read the folder of a live run")  # claim must not read them
        monkeypatch.setattr(sys.modules["tupe_jax.workdir.claim"], "check_config", gate)
        with pytest.raises(UserError, match=f"is in use by process {holder.pid} on"):
            with workdir_lib.claim(wd, load_config()):
                pass
        assert tree(wd) == before
        monkeypatch.undo()
        monkeypatch.setattr(jax, "process_index", lambda: 1)    # process 1 of a run whose process 0 holds the lock:
        with workdir_lib.claim(wd, load_config()):               # the lock is not its to check
            pass
        monkeypatch.undo()
        assert tree(wd) == before
    finally:
        holder.kill()                                                       # SIGKILL: no chance to clean up
        holder.wait()
    assert os.path.exists(os.path.join(wd, ".lock"))                        # its file stays behind ...
    before = tree(wd)
    workdir_lib.refuse_if_held(wd)                                          # ... held by nobody ...
    workdir_lib.refuse_if_held(str(tmp_path / "new"))
    assert tree(wd) == before and not os.path.exists(tmp_path / "new")
    with workdir_lib.RunLock(wd) as lock:                                   # ... but not its lock
        assert lock.taken_over and str(holder.pid) in lock.taken_over
        with workdir_lib.RunLock(wd):                                       # re-entrant in one process
            pass
        assert os.path.exists(os.path.join(wd, ".lock"))
    assert not os.path.exists(os.path.join(wd, ".lock"))


def test_a_probe_of_the_lock_does_not_refuse_a_run_taking_it(tmp_path, monkeypatch):
    """`refuse_if_held` tries a shared flock and drops it at once. A run whose exclusive flock lands in that
    instant tries again (BUSY_TRIES) instead of calling the folder in use."""
    import fcntl  # pylint: disable=import-outside-toplevel
    lock_lib = sys.modules["tupe_jax.workdir.lock"]
    wd = tmp_path / "run"
    wd.mkdir()
    probe = open(wd / ".lock", "a+", encoding="utf-8")  # pylint: disable=consider-using-with
    fcntl.flock(probe.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)      # another command's probe, mid-check
    sleeps = []

    def probe_ends(seconds):                                         # ... which ends while the run waits
        sleeps.append(seconds)
        fcntl.flock(probe.fileno(), fcntl.LOCK_UN)
    monkeypatch.setattr(lock_lib.time, "sleep", probe_ends)
    try:
        with workdir_lib.RunLock(str(wd)) as lock:
            assert lock.taken_over is None and sleeps == [lock_lib.BUSY_RETRY_SECONDS]
    finally:
        probe.close()
    other = open(wd / ".lock", "a+", encoding="utf-8")  # pylint: disable=consider-using-with
    fcntl.flock(other.fileno(), fcntl.LOCK_SH)                      # a lock that is not released: refused after
    monkeypatch.setattr(lock_lib.time, "sleep", sleeps.append)       # BUSY_TRIES tries
    sleeps.clear()
    try:
        with pytest.raises(UserError, match="is in use by another process"):
            with workdir_lib.RunLock(str(wd)):
                pass
    finally:
        other.close()
    assert len(sleeps) == lock_lib.BUSY_TRIES - 1


@pytest.mark.slow
def test_two_pretrain_processes_on_one_workdir_then_kill_9_and_resume(tmp_path):
    """Exactly one of two concurrent `launch pretrain` runs on a folder; the other gets the lock message and
    writes nothing. After kill -9 of the first, the same command takes the stale lock over and resumes."""
    wd = str(tmp_path / "run")
    argv = [sys.executable, "-m", "launch", "pretrain", "--config=configs/pretrain.py:pe=tupe_r", f"--workdir={wd}",
            "--config.model.hidden_size=32", "--config.model.num_layers=1", "--config.model.num_heads=2",
            "--config.model.mlp_dim=64", "--config.model.vocab_size=512", "--config.model.max_len=32",
            "--config.train.steps=100000", "--config.train.batch_size=8", "--config.train.log_every=1",
            "--config.checkpoint.every=5", "--config.checkpoint.async_save=false",
            f"--config.data.cache_dir={tmp_path / 'cache'}"]
    env = {**os.environ, "XLA_FLAGS": xla_flags.devices(1)}
    first = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in first.stdout:            # wait until it trains (and so holds the folder)
            if line.startswith("step 12/"):
                break
        files_before = sorted(os.listdir(wd))
        second = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
        errors = [ln for ln in second.stderr.splitlines() if ln.startswith("error:")]
        assert second.returncode == 2 and len(errors) == 1, second.stderr[-2000:]
        assert f"is in use by process {first.pid}" in errors[0] and "Traceback" not in second.stderr
        assert sorted(os.listdir(wd)) == files_before
    finally:
        first.kill()                         # kill -9: no cleanup, the lock file stays
        first.wait()
    steps = workdir_lib.checkpoint_steps(wd)
    assert steps and os.path.exists(os.path.join(wd, ".lock"))
    third = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in third.stdout:
            seen.append(line)
            if line.startswith(f"resumed from step {steps[-1]}"):
                break
        third.send_signal(signal.SIGTERM)    # graceful: saves and exits 0
        rest, _ = third.communicate(timeout=300)
    finally:
        if third.poll() is None:
            third.kill()
    text = "".join(seen) + rest
    assert "taking over the lock left by process" in text and str(first.pid) in text, text[-2000:]
    assert third.returncode == 0, text[-2000:]
    latest = workdir_lib.checkpoint_steps(wd)[-1]      # SIGTERM in its first step (compiling) saves nothing new
    assert latest > steps[-1] or (latest == steps[-1] and f"nothing saved; a rerun starts from step {latest}" in text)
    assert not os.path.exists(os.path.join(wd, ".lock"))


class _FakeBucket:
    """A gs:// folder's lease object in memory: `reads` are served in order (the last one repeats), each as
    generation 1; writes and removals kept."""

    def __init__(self, reads):
        self.reads, self.writes, self.removed = list(reads), [], []

    def read_object(self, path):
        return (self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]), 1

    def write_object(self, path, text, generation):
        self.writes.append(text)
        return generation + 1

    def delete_object(self, path, generation):
        self.removed.append(path)
        return True

    def install(self, monkeypatch):
        from tupe_jax import files  # pylint: disable=import-outside-toplevel
        from tupe_jax.workdir import lock as lock_lib  # pylint: disable=import-outside-toplevel
        monkeypatch.setattr(files, "is_remote", lambda p: str(p).startswith("gs://"))
        monkeypatch.setattr(files, "absolute", lambda p: str(p))
        for name in ("read_object", "write_object", "delete_object"):
            monkeypatch.setattr(files, name, getattr(self, name))
        monkeypatch.setattr(lock_lib, "LEASE_RETRY_SECONDS", 0.0)
        return lock_lib


def test_a_torn_read_of_a_live_bucket_lease_is_read_again_not_taken_over(monkeypatch):
    """A read that overlaps the holder's heartbeat rewrite returns a torn object. Before, that counted as a stale
    lease and a second process took over a live run's folder; now the lease is read again and the live holder
    refuses. A lease that never parses is still taken over, after LEASE_READS reads."""
    import time  # pylint: disable=import-outside-toplevel
    live = json.dumps({"pid": 4242, "host": "vm-1", "started": "2026-12-01T00:00:00", "command": "launch pretrain",
                       "heartbeat": time.time()})
    bucket = _FakeBucket([live[:len(live) // 2], live])
    lock_lib = bucket.install(monkeypatch)
    with pytest.raises(UserError, match="is in use by process 4242 on vm-1"):
        with lock_lib.RunLock("gs://b/run"):
            pass
    assert bucket.writes == []                                   # nothing written over the live lease
    broken = _FakeBucket(["{not json"])
    lock_lib = broken.install(monkeypatch)
    reads = []
    monkeypatch.setattr("tupe_jax.files.read_object", lambda p: (reads.append(p) or "{not json", 1))
    with lock_lib.RunLock("gs://b/run2") as lock:
        assert lock.taken_over == "another process" and len(reads) == lock_lib.LEASE_READS
        assert len(broken.writes) == 1                           # the heartbeat thread does not write at once
    assert broken.removed == ["gs://b/run2/.lock"]


class _GenerationBucket:
    """google-cloud-storage blobs of one bucket in memory, with GCS's generation preconditions on write and delete
    (fake-gcs-server, the suite's emulator, ignores them on DELETE, so `tests/test_gcs.py` cannot see them there)."""

    def __init__(self):
        self.objects, self.generations = {}, 0

    def blob(self, path):
        from google.api_core import exceptions  # pylint: disable=import-outside-toplevel
        bucket = self

        class Blob:
            generation = None

            def _check(self, expected):
                now = bucket.objects.get(path, (b"", 0))[1]
                if expected is not None and int(expected) != now:
                    raise exceptions.PreconditionFailed(f"{path} is at generation {now}, not {expected}")

            def download_as_bytes(self):
                if path not in bucket.objects:
                    raise exceptions.NotFound(path)
                data, self.generation = bucket.objects[path]
                return data

            def upload_from_string(self, data, content_type=None, if_generation_match=None):
                self._check(if_generation_match)
                bucket.generations += 1
                bucket.objects[path] = (data, bucket.generations)
                self.generation = bucket.generations

            def delete(self, if_generation_match=None):
                if path not in bucket.objects:
                    raise exceptions.NotFound(path)
                self._check(if_generation_match)
                del bucket.objects[path]

        return Blob()


def test_bucket_objects_are_written_and_deleted_only_at_the_generation_last_seen(monkeypatch):
    """`files.write_object`/`delete_object` pass the generation they were given, and a holder whose lease was taken
    over (after its last heartbeat, before it noticed) does not delete the new holder's lease when it ends."""
    from tupe_jax import files  # pylint: disable=import-outside-toplevel
    from tupe_jax.workdir import lock as lock_lib  # pylint: disable=import-outside-toplevel
    bucket = _GenerationBucket()
    monkeypatch.setattr(files, "_blob", bucket.blob)
    path = "gs://b/x.json"
    first = files.write_object(path, "a", 0)
    with pytest.raises(FileExistsError):
        files.write_object(path, "b", 0)
    second = files.write_object(path, "b", first)
    assert files.read_object(path) == ("b", second) and second != first
    assert files.delete_object(path, first) is False and files.read_object(path) == ("b", second)
    assert files.delete_object(path, second) is True and files.read_object(path) == ("", 0)
    assert files.delete_object(path, second) is False

    monkeypatch.setattr(files, "is_remote", lambda p: str(p).startswith("gs://"))
    monkeypatch.setattr(files, "absolute", lambda p: str(p))
    with lock_lib.RunLock("gs://b/run") as lock:
        lease = lock_lib._HELD["gs://b/run"][0]   # pylint: disable=protected-access
        mine = lease.generation
        theirs = files.write_object(lock.path, '{"pid": 7, "host": "vm-2"}', mine)   # a takeover
    assert files.read_object(lock.path) == ('{"pid": 7, "host": "vm-2"}', theirs)
    with lock_lib.RunLock("gs://b/run2") as lock:
        pass
    assert files.read_object(lock.path) == ("", 0)                  # a lease still its holder's is removed


def test_a_failed_command_puts_its_folder_back_before_it_releases_the_lock(tmp_path, monkeypatch):
    """The folder of a failed command was put back after its lock was released: a launch that took the folder in
    between could lose its new files to that clean-up. Now the lock is held until the folder is as it was."""
    wd, seen, undo = str(tmp_path / "run"), [], Before.undo
    workdir_lib.write_config(wd, load_config())

    def undo_and_look(self):        # what another launch's RunLock would meet now
        try:
            with open(os.path.join(wd, ".lock"), encoding="utf-8") as f:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
                seen.append("free")
        except FileNotFoundError:
            seen.append("released")
        except BlockingIOError:
            seen.append("held")
        undo(self)

    monkeypatch.setattr(Before, "undo", undo_and_look)
    with pytest.raises(RuntimeError):
        with workdir_lib.claim(wd, load_config(**{"checkpoint.every": 50})):
            raise RuntimeError("boom")
    assert seen == ["held"] and workdir_lib.read_config(wd).checkpoint.every == 1000
    assert not os.path.exists(os.path.join(wd, ".lock"))
