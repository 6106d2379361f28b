"""One run per folder: an exclusive lock on `<workdir>/.lock`.

The lock is an `fcntl.flock` on the file, so it belongs to the process that holds it and dies with it: a run
killed with SIGKILL leaves the file behind but not the lock, and the next command takes it over (saying whose
it was). The file records who holds it (host, pid, start time, command) for the message a second process gets.
Locks are re-entrant within a process (a launcher command and the library loop it calls claim the same folder).
Process 0 of a multi-process run holds the lock for all of them. `refuse_if_held` asks the same question without
taking anything (a shared flock tried and dropped, or the lease read), so a command can refuse a folder in use
before it reads the live run's checkpoints.

In a bucket (`gs://...`) there is no flock: the lock is a lease object that its holder rewrites every
`LEASE_SECONDS / 4` (a heartbeat thread). A lease whose heartbeat is older than `LEASE_SECONDS` (300 s, or
$TUPE_JAX_LEASE_SECONDS) belongs to a dead run (a preempted VM) and is taken over. Every write of the lease is
conditional on the object generation its writer last saw (`files.write_object`): a new lease on "no object", a
takeover on the stale lease's generation, a heartbeat on its own last write. So of two commands that saw the folder
free, or saw the same stale lease, exactly one gets it and the other is refused naming the winner; and a holder
that was taken for dead (no heartbeat for `LEASE_SECONDS`) finds its next heartbeat refused, says so on stderr and
stops beating, instead of overwriting the new holder's lease. Before each checkpoint the training loop asks
`check_held`, which reads the lease's generation (a stalled VM's main thread may reach a save before its heartbeat
thread notices): a lease that is no longer this run's stops the run with `LeaseLost` before it writes. On release a
lease is deleted only if it is still the holder's own generation. A lease that does not parse is read again
(`LEASE_READS` times, `LEASE_RETRY_SECONDS` apart) before it counts as stale.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from typing import Optional

from tupe_jax import files

from tupe_jax.errors import UserError

LOCK_NAME = ".lock"
LEASE_SECONDS = float(os.environ.get("TUPE_JAX_LEASE_SECONDS", "300"))   # a bucket lease's lifetime without heartbeat
_HELD: dict[str, list] = {}     # absolute workdir -> [file object, depth]
LEASE_READS, LEASE_RETRY_SECONDS = 5, 0.5     # an unparsable lease is read this often before it counts as stale
BUSY_TRIES, BUSY_RETRY_SECONDS = 5, 0.02      # a busy flock is tried this often before the folder counts as in use
BUSY_ERRNOS = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)   # what a non-blocking flock of a held lock raises


def _holder(text: str) -> str:
    try:
        info = json.loads(text)
        return f"process {info['pid']} on {info['host']} (started {info['started']}: {info['command']})"
    except (ValueError, KeyError, TypeError):
        return "another process"


def _read_lease(path: str) -> tuple[str, float, int]:
    """The lease object's text, its heartbeat's age in seconds (LEASE_SECONDS if it never parses) and its
    generation (0: there is no lease)."""
    for attempt in range(LEASE_READS):
        text, generation = files.read_object(path)
        if not generation:
            return "", 0.0, 0
        try:
            return text, time.time() - float(json.loads(text).get("heartbeat", 0)), generation
        except (ValueError, AttributeError):
            if attempt + 1 < LEASE_READS:
                time.sleep(LEASE_RETRY_SECONDS)
    return text, LEASE_SECONDS, generation


class LeaseLost(UserError):
    """This run's bucket lease was taken over by another command (this run went `LEASE_SECONDS` without a
    heartbeat and was taken for dead): the folder is that command's now, so nothing of it may be removed."""


def check_held(workdir: str) -> None:
    """`LeaseLost` if this process holds `workdir`'s bucket lease and it is no longer this run's. A no-op for a local
    folder (an flock cannot be taken away) and for a folder this process does not hold (the other processes of a
    multi-process run: process 0 holds it for them)."""
    held = _HELD.get(files.absolute(workdir))
    if held is not None and isinstance(held[0], _Lease):
        held[0].confirm()


def owns_folder(workdir: str) -> bool:
    """False if this process held `workdir`'s bucket lease and another launch has taken it over (`check_held`)."""
    try:
        check_held(workdir)
    except LeaseLost:
        return False
    return True


def _in_use_local(workdir: str, text: str) -> UserError:
    return UserError(f"{workdir} is in use by {_holder(text)}", "--workdir",
                     "wait for that run to finish (or stop it), or use another workdir")


def _in_use_remote(workdir: str, text: str, age: float) -> UserError:
    return UserError(f"{workdir} is in use by {_holder(text)}, heartbeat {age:.0f} s ago", "--workdir",
                     f"wait for that run to finish (a dead run's lease expires {LEASE_SECONDS:.0f} s after its last "
                     "heartbeat), or use another workdir")


def _stale_lease(workdir: str, path: str) -> tuple[str, float, int]:
    """(text, heartbeat age, generation) of the bucket lease at `path`, generation 0 if there is none; UserError
    if it is live."""
    text, age, generation = _read_lease(path)
    if generation and age < LEASE_SECONDS:
        raise _in_use_remote(workdir, text, age)
    return text, age, generation


def refuse_if_held(workdir: str) -> None:
    """UserError if another process holds `workdir`'s lock now; writes nothing (a folder's gate reads checkpoints
    that a live run is still writing and pruning, so a command checks this first). The lock itself is still
    taken later (`RunLock`): a run that starts in between is caught there."""
    workdir = files.absolute(workdir)
    path = files.join(workdir, LOCK_NAME)
    if workdir in _HELD:
        return
    if files.is_remote(workdir):
        _stale_lease(workdir, path)
        return
    try:
        f = open(path, "r", encoding="utf-8")  # pylint: disable=consider-using-with
    except OSError:        # no lock file (or none readable): nothing to ask; RunLock decides when it takes the lock
        return
    with f:
        try:   # a shared lock is refused while the holder has its exclusive one; released at once
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in BUSY_ERRNOS:
                raise
            raise _in_use_local(workdir, f.read()) from None
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class RunLock:
    """`with RunLock(workdir): ...` holds the folder's lock; a second holder gets a one-line UserError."""

    def __init__(self, workdir: str):
        self.workdir = files.absolute(workdir)
        self.path = files.join(self.workdir, LOCK_NAME)
        self.taken_over: Optional[str] = None   # who held a stale lock file we took over

    def _identity(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
                "started": datetime.datetime.now().isoformat(timespec="seconds")}

    def _enter_remote(self) -> None:
        """The lease object of a bucket folder (see the module doc)."""
        path = files.join(self.workdir, LOCK_NAME)
        text, age, stale = _stale_lease(self.workdir, path)
        if stale:
            self.taken_over = _holder(text)
            print(f"{self.workdir}: taking over the lease left by {self.taken_over} (no heartbeat for {age:.0f} s)",
                  file=sys.stderr, flush=True)
        lease = _Lease(self.workdir, path, self._identity())
        try:
            lease.generation = files.write_object(path, lease.text(), stale)
        except FileExistsError:      # another command created it, or took the stale one over, since we read it
            text, age, _ = _read_lease(path)
            raise _in_use_remote(self.workdir, text, age) from None
        lease.start()
        _HELD[self.workdir] = [lease, 1]

    def __enter__(self) -> "RunLock":
        held = _HELD.get(self.workdir)
        if held is not None:
            held[1] += 1
            return self
        if files.is_remote(self.workdir):
            self._enter_remote()
            return self
        os.makedirs(self.workdir, exist_ok=True)
        f = self._acquire()
        f.seek(0)
        previous = f.read().strip()
        if previous:   # the file of a process that died without releasing: the kernel already dropped its lock
            self.taken_over = _holder(previous)
            print(f"{self.workdir}: taking over the lock left by {self.taken_over}, which is no longer running",
                  file=sys.stderr, flush=True)
        f.seek(0)
        f.truncate()
        f.write(json.dumps(self._identity()))
        f.flush()
        _HELD[self.workdir] = [f, 1]
        return self

    def _acquire(self):
        """The locked lock file (retried if a releasing holder removed it between our open and our lock, and
        `BUSY_TRIES` times while the lock is busy: another command's `refuse_if_held` holds it for an instant)."""
        busy = 0
        while True:
            f = open(self.path, "a+", encoding="utf-8")  # pylint: disable=consider-using-with
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                f.seek(0)
                text = f.read()
                f.close()
                if err.errno not in BUSY_ERRNOS:
                    raise
                busy += 1
                if busy < BUSY_TRIES:
                    time.sleep(BUSY_RETRY_SECONDS)
                    continue
                raise _in_use_local(self.workdir, text) from None
            try:
                if os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino:
                    return f
            except FileNotFoundError:
                pass
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            f.close()

    def __exit__(self, *exc) -> None:
        held = _HELD.get(self.workdir)
        if held is None:
            return
        held[1] -= 1
        if held[1] > 0:
            return
        del _HELD[self.workdir]
        if files.is_remote(self.workdir):
            held[0].release()
            return
        f = held[0]
        try:
            if os.path.exists(self.path):
                os.remove(self.path)       # still ours: nobody can hold it while we do
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            f.close()


class _Lease:
    """A held bucket lease and its heartbeat thread; `generation` is the lease's last write (None once lost)."""

    def __init__(self, workdir: str, path: str, identity: dict):
        self.workdir, self.path, self.identity = workdir, path, identity
        self.generation: Optional[int] = None
        self.lost_to: Optional[str] = None       # the holder that took the lease over, once seen
        self._writing = threading.Lock()         # a heartbeat and a `confirm` see each other's generation
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="tupe-jax-lease")

    def text(self) -> str:
        return json.dumps({**self.identity, "heartbeat": time.time()})

    def start(self) -> None:
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(LEASE_SECONDS / 4):
            try:
                if not self._renew():
                    return
            except Exception as err:  # pylint: disable=broad-exception-caught
                # a storage error that outlived the client's own retries: a dead heartbeat thread would let the
                # lease expire under a live run, so say so and try again at the next beat
                print(f"warning: {self.path}: renewing the lease failed ({type(err).__name__}: "
                      f"{str(err).splitlines()[0] if str(err) else ''}), trying again in {LEASE_SECONDS / 4:.0f} s",
                      file=sys.stderr, flush=True)

    def _renew(self) -> bool:
        """One heartbeat; False once the lease is another's."""
        with self._writing:
            if self.lost_to is not None:
                return False
            text = self.text()
            try:
                self.generation = files.write_object(self.path, text, self.generation)
                return True
            except FileExistsError:
                pass
            now, generation = files.read_object(self.path)
            if now == text:               # our write landed and only its reply was lost (a retried upload)
                self.generation = generation
                return True
            self._lose(now)
        print(f"error: {self._lost()}, {self.path}, this run stops before its next checkpoint (it no longer renews "
              "or removes the lease)", file=sys.stderr, flush=True)
        return False

    def _lose(self, text: str) -> None:
        """The lease is no longer this run's: another holder's text, or "" (the object is gone)."""
        self.generation, self.lost_to = None, _holder(text) if text else ""

    def _lost(self) -> str:
        if self.lost_to == "":
            return (f"this run's lease object {self.path} is gone (the run folder or its bucket was deleted, or the "
                    "lease removed by hand)")
        return (f"this run's lease on {self.workdir} was taken over by {self.lost_to} (this run went "
                f"{LEASE_SECONDS:.0f} s without a heartbeat and was taken for dead)")
        self._stop.set()

    def confirm(self) -> None:
        """`LeaseLost` unless the lease object is still at this run's last write (asked before a checkpoint and
        before a metrics rewrite). A read that fails with a storage error (after the client's own retries) is
        reported and the write goes ahead: the heartbeat still guards the lease."""
        with self._writing:
            if self.lost_to is None:
                try:
                    now, generation = files.read_object(self.path)
                except Exception as err:  # pylint: disable=broad-exception-caught
                    print(f"warning: {self.path}: reading the lease failed ({type(err).__name__}: "
                          f"{(str(err).splitlines() or [''])[0]}); writing anyway, the heartbeat still checks it",
                          file=sys.stderr, flush=True)
                    return
                if generation != self.generation:
                    self._lose(now)
        if self.lost_to == "":
            raise LeaseLost(f"{self._lost()}, so it stops before its next checkpoint", "--workdir",
                            "check the bucket and the folder; rerun the command to resume from the newest "
                            "checkpoint still there")
        if self.lost_to is not None:
            raise LeaseLost(f"{self._lost()}, so it stops before its next checkpoint", "--workdir", "the folder is "
                            "that command's now: let it finish (or stop it) before resuming this run there, or "
                            "start this run in another folder")

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.generation is not None:   # never another holder's lease
            files.delete_object(self.path, self.generation)
