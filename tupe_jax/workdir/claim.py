"""`claim(workdir, config)`: the one way a command takes a run folder.

In order, before the command computes anything: the folder path is usable (`check_folder`), no other process holds
it (process 0: `lock.refuse_if_held`, read only, so a live run's pruning of old checkpoints cannot race the gate's
reads), the processes of a multi-process run agree (`agree`: the same folder, seen alike, and if any process's
checks failed every process stops with that line), the config passes the gate (`gate.check_config`: nothing written
yet), every process has passed it (`wait_for_all_processes`: a multi-process run decides from the folder which
collective reads to make, so it must not change under a late process's checks), the folder's lock is taken
(`lock.RunLock`), config.json is stored and a provenance row appended (process 0; `provenance.py`; then `agree`
again, so a failure there stops every process; an unexpected error in the checks or this step is shared as well, as
its type and first line), and every other process of a run in a local folder sees that config.json
(`see_what_process_0_wrote`: a folder of each host's own is refused before any compute, even for a fresh run). If
the command then fails — a UserError or anything unexpected, but not an interrupt — and produced no checkpoint or
results, the folder is put back as it was (`undo.Before`: what it created is removed, the files the claim rewrote
get their text back) before the lock is released. A run whose bucket lease was taken over (`still_held`, asked
before every checkpoint) stops and removes nothing: the folder is the other command's.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from typing import Any, Callable, Iterator, Optional

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from tupe_jax import files
from tupe_jax.checkpoint import committed
from tupe_jax.config import flatten
from tupe_jax.errors import UserError
from tupe_jax.workdir import provenance
from tupe_jax.workdir.gate import check_config, store_config
from tupe_jax.workdir.lock import LeaseLost, RunLock, check_held, refuse_if_held
from tupe_jax.workdir.undo import Before


def check_bucket(path: str, where: str = "--workdir") -> None:
    """`files.check_bucket` (the path's shape, the bucket's existence, the storage's answer), `--workdir` by default."""
    files.check_bucket(path, where)


def check_folder(workdir: str, writable: bool = True) -> None:
    """`workdir` is a non-empty path to a folder (or to nothing yet) that this process can write."""
    if not str(workdir).strip():
        raise UserError("--workdir is empty", "--workdir", "give a folder, e.g. --workdir=runs/x")
    if files.is_remote(workdir):
        check_bucket(workdir)
        return
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise UserError(f"{workdir} is a file, not a folder", "--workdir", "give a folder path")
    if os.path.islink(workdir) and not os.path.exists(workdir):
        raise UserError(f"{workdir} is a link to {os.readlink(workdir)}, which does not exist", "--workdir",
                        "create the folder it points at, or give another workdir")
    if not writable:
        return
    existing = os.path.abspath(workdir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{existing} is not writable by this user", "--workdir",
                        "fix its permissions or give a workdir you can write")
    try:   # access() says yes to root on read-only mounts: try for real
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise UserError(f"{existing} is not writable ({err.strerror})", "--workdir",
                        "give a workdir on a writable disk") from None


def refuse_in_checkpoints(path: str, workdirs: Any, where: str) -> None:
    """An output folder `path` is not inside a run's checkpoints/ (a folder there named like a step is read as
    one: every command reading the newest step would then fail on it)."""
    def resolved(p: str) -> str:       # a local path through its links (a linked --workdir is the same run)
        return (files.absolute(p) if files.is_remote(p) else os.path.realpath(os.path.expanduser(p))).rstrip("/")

    target = resolved(path) + "/"
    for workdir in [workdirs] if isinstance(workdirs, (str, os.PathLike)) else workdirs:   # one run or several
        if target.startswith(files.join(resolved(str(workdir)), "checkpoints") + "/"):
            raise UserError(f"{path} is inside the checkpoints of {workdir}", where,
                            "give a folder outside checkpoints/ (e.g. <workdir>/exports/NAME or another folder)")
    if not files.is_remote(path):      # any run's: a new run (an import) names no other run to check against
        folder = os.path.dirname(target.rstrip("/"))
        while folder != os.path.dirname(folder):
            run = os.path.dirname(folder)       # a run of ours: config.json and provenance.jsonl beside it
            if os.path.basename(folder) == "checkpoints" and all(
                    os.path.isfile(os.path.join(run, n)) for n in ("config.json", "provenance.jsonl")):
                raise UserError(f"{path} is inside the checkpoints of {os.path.dirname(folder)}", where,
                                "give a folder outside checkpoints/")
            folder = os.path.dirname(folder)


def view(workdir: str) -> str:
    """What this process sees of `workdir` that decides the gate's reads: the folder, config.json, checkpoint steps."""
    if not files.isdir(workdir):
        return "no folder"
    ckpt = files.join(workdir, "checkpoints")
    config = "config.json" if files.exists(files.join(workdir, "config.json")) else "no config.json"
    if not files.isdir(ckpt):
        return f"{config}, no checkpoints/"
    steps = sorted(int(d) for d in files.listdir(ckpt) if d.isdigit() and committed(files.join(ckpt, d)))
    return f"{config}, checkpoints/ with {len(steps)} steps" + (f" (newest {steps[-1]})" if steps else "")


def gather(mine: dict) -> list[dict]:
    """Every process's `mine` (a JSON-able dict), in process order: the longest row's length, then the rows as
    zero-padded bytes (two `process_allgather`s)."""
    data = json.dumps(mine).encode("utf-8")
    size = int(multihost_utils.process_allgather(np.asarray([len(data)], np.int32)).max())
    row = np.zeros(size, np.uint8)
    row[:len(data)] = np.frombuffer(data, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(row)).reshape(-1, size)
    return [json.loads(bytes(r).rstrip(b"\0").decode("utf-8")) for r in rows]


SHARE_ONE_FOLDER = ("give every process one folder they share: a network file system mounted at the same path on "
                    "every host, or a gs:// path")


def error_row(failure: Optional[Exception]) -> Optional[list[str]]:
    """The (what, where, fix) another process prints for `failure`: a UserError's own line; for anything
    unexpected (a storage or transport error, say) its type and first line, pointing at the failing process's
    traceback."""
    if failure is None:
        return None
    if isinstance(failure, UserError):
        return [failure.what, failure.where, failure.fix]
    first = (str(failure).splitlines() or [""])[0][:160]
    return [f"{type(failure).__name__}: {first}" if first else type(failure).__name__, "--workdir",
            "see the traceback of that process"]


def agree(workdir: str, failure: Optional[Exception], sees: str, stage: str,
          same: Optional[dict[str, str]] = None) -> None:
    """A multi-process run: every process stops here, with one line, if any process's checks failed (`failure`, a
    UserError or anything unexpected; some checks are process 0's alone, and a process that stopped alone would
    leave the others waiting at the next collective call), if the processes were given different workdirs, or if
    they see the folder differently (`sees`: `view`; a local folder that is not shared between hosts). The failing
    process raises its own `failure`. `stage` names the step in the gathered rows ("checks" before the gate, "lock"
    after process 0 took it, "shared" once the others looked for its config.json). `same`: what every process must
    have been given alike ({'--config.train.learning_rate': '0.3', ...}: a run's config, or a command line); a key
    that differs is refused, naming it and both values. One process: raise `failure`, if any."""
    if jax.process_count() == 1:
        if failure is not None:
            raise failure
        return
    me, path = jax.process_index(), files.absolute(workdir)
    everyone = gather({"stage": stage, "workdir": hashlib.sha256(path.encode("utf-8")).hexdigest(), "sees": sees,
                       "error": error_row(failure), "same": same or {}})
    if len({p["workdir"] for p in everyone}) > 1:
        raise UserError(f"the processes of this run were given different workdirs ({path} on process {me})",
                        "--workdir", "give every process the same --workdir: a folder they share or a gs:// path")
    if failure is not None:
        raise failure
    for k, p in enumerate(everyone):
        if p["error"] is not None:
            what, where, fix = p["error"]
            raise UserError(f"{what} (found by process {k}; this is process {me})", where, fix)
    for k, p in enumerate(everyone):     # after the failures: a key a failed check left unset differs too
        key = next((key for key in sorted(set(p["same"]) | set(everyone[0]["same"]))
                    if p["same"].get(key) != everyone[0]["same"].get(key)), None)
        if key is not None:
            raise UserError(f"the processes of this run were given different values of {key} ("
                            f"{everyone[0]['same'].get(key, 'none')} on process 0, {p['same'].get(key, 'none')} on "
                            f"process {k})", key, "run the same command line on every process (host)")
    if len({p["sees"] for p in everyone}) > 1:
        seen = "; ".join(f"process {k}: {p['sees']}" for k, p in enumerate(everyone))
        raise UserError(f"the processes of this run see different contents in {path} ({seen})", "--workdir",
                        SHARE_ONE_FOLDER)


def same_config(config: ml_collections.ConfigDict) -> Optional[dict[str, str]]:
    """{'--config.<key>': repr(value)} of a multi-process run's config (None for one process: nothing to compare)."""
    if jax.process_count() == 1:
        return None
    flat = flatten(config.to_dict())
    return {f"--config.{k}": repr(v) for k, v in flat.items()}


SHARED_WAIT_SECONDS = float(os.environ.get("TUPE_JAX_SHARED_WAIT_SECONDS", "90"))


def see_what_process_0_wrote(workdir: str) -> None:
    """A process other than 0 of a run in a local folder: process 0's config.json is visible here, so the folder is
    one they share (a fresh run on a disk of each host's own would look alike, empty, to every process's checks).
    An NFS client may hide a file another host just created for up to its attribute-cache time (`acdirmax`, 60 s
    by default), so a miss is retried for `SHARED_WAIT_SECONDS` before it is refused. A bucket is strongly
    consistent: nothing to check."""
    if files.is_remote(workdir):
        return
    path = files.join(workdir, "config.json")
    deadline = time.monotonic() + SHARED_WAIT_SECONDS
    while not os.path.isfile(path):
        if time.monotonic() >= deadline:
            raise UserError(f"{path}, written by process 0, is not visible on process {jax.process_index()} after "
                            f"{SHARED_WAIT_SECONDS:.0f} s (is {workdir} a folder of this host's own?)", "--workdir",
                            SHARE_ONE_FOLDER)
        with contextlib.suppress(OSError):
            os.listdir(os.path.dirname(path) or ".")      # a directory read, to revalidate a cached lookup
        time.sleep(0.5)


def wait_for_all_processes(workdir: str) -> None:
    """A multi-process run: return once every process has passed the checks. They read the folder, and what they
    find decides which collective calls follow (Orbax's reads of `checkpoints/`, which each begin with a barrier,
    run only if it exists), so no process may write it — process 0 takes the lock, then creates `checkpoints/` —
    while another, started late, is still checking."""
    if jax.process_count() == 1:
        return
    multihost_utils.sync_global_devices(f"tupe_jax.claim {files.absolute(workdir)}")


_CLAIMED: set[str] = set()   # folders this process is inside a claim of


@contextlib.contextmanager
def claim(workdir: str, config: ml_collections.ConfigDict, overwrite: Optional[bool] = None,
          kind: Optional[str] = None, validate: Optional[Callable[[], Any]] = None) -> Iterator[None]:
    """Check, lock and write `workdir` for a command that runs `config` there (see the module doc). `overwrite`:
    the launcher's --overwrite_config (None from library callers, which have no such option); `kind`: the
    command, for the gate (`check_config`); `validate`: the command's config checks, run first (their failure on
    one process stops every process: `agree`)."""
    lead = jax.process_index() == 0
    key = files.absolute(workdir)
    if key in _CLAIMED:   # nested (the launcher's claim, then the loop's), on every process alike: Orbax's reads
        yield             # in the gate are collective in a multi-process run, so all processes must skip it
        return
    failure, sees = None, ""
    try:
        if validate is not None:
            validate()
        check_folder(workdir, writable=lead)
        if lead:                         # before the gate reads checkpoints that a live run may be pruning (the
            refuse_if_held(workdir)      # other processes of this run find the lock that process 0 takes: not theirs)
        if jax.process_count() > 1:
            sees = view(workdir)
    except Exception as err:  # pylint: disable=broad-except  # shared by `agree`, which raises it here again
        failure = err
    agree(workdir, failure, sees, stage="checks", same=same_config(config))
    failure, changes = None, []
    try:
        changes = check_config(workdir, config, overwrite=overwrite, kind=kind)   # refuse before anything is written
        if jax.process_count() > 1:    # the gate's agreement below waits for them (a late host's checks)
            print(f"{workdir}: process {jax.process_index()} of {jax.process_count()} passed the workdir checks; "
                  "waiting for the other processes", flush=True)
    except Exception as err:  # pylint: disable=broad-except  # as above
        failure = err
    agree(workdir, failure, "", stage="gate")
    wait_for_all_processes(workdir)
    with contextlib.ExitStack() as held:   # exits in reverse: the undo, the lock's release, then the empty folders
        failure = None
        try:                 # process 0 alone; another launch may have taken the lock since refuse_if_held
            if lead:
                before = Before.take(workdir)
                held.push(_on_failure(before.remove_new_folders))
                held.enter_context(RunLock(workdir))
                held.push(_on_failure(before.undo))
                store_config(workdir, config, changes)
                provenance.record(workdir)
        except Exception as err:  # pylint: disable=broad-except  # as above
            failure = err
        agree(workdir, failure, "", stage="lock")
        if jax.process_count() > 1:
            failure = None
            try:
                if not lead:
                    see_what_process_0_wrote(workdir)
            except UserError as err:
                failure = err
            agree(workdir, failure, "", stage="shared")
        _CLAIMED.add(key)
        try:
            yield
        finally:
            _CLAIMED.discard(key)


def _on_failure(action: Callable[[], None]) -> Callable[..., bool]:
    """An exit callback for an ExitStack: `action()` if the block failed (a UserError or anything unexpected), but
    not on an interrupt (Ctrl-C keeps everything: the same command continues where it stopped) nor when the bucket
    lease was taken over (`LeaseLost`: the folder is another command's now, nothing in it is this one's to remove)."""
    def on_exit(kind: Any, err: Optional[BaseException], trace: Any) -> bool:  # pylint: disable=unused-argument
        if isinstance(err, Exception) and not isinstance(err, LeaseLost):
            action()
        return False
    return on_exit


def still_held(workdir: str) -> None:
    """Before a checkpoint: every process of the run stops (process 0 with `LeaseLost`, the others with its line) if
    the folder's bucket lease, held by process 0, was taken over (`lock.check_held`). A collective call in a
    multi-process run, so every process calls it at the same steps."""
    failure = None
    if jax.process_index() == 0:
        try:
            check_held(workdir)
        except LeaseLost as err:
            failure = err
    agree(workdir, failure, "", stage="lease")
