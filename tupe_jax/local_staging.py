"""Local folders that stage files for a bucket, and the removal of those a killed process left behind.

A run or command writing to a bucket (`gs://...`) first writes some of its files to a local temporary folder and
uploads them from there: TensorBoard's event files (metrics.py), a profile's trace (trainer.py), an analysis's
outputs (analysis/common.py), a bucket export (interop/export.py). The writer removes its folder when done; a
process killed with -9 or by the kernel's OOM killer removes nothing, and each restart of such a run would leave
another folder (TensorBoard's events of every step it logged) in the machine's temporary folder.

    make(kind) -> path   a new empty folder <tmp>/tupe-jax-<kind>-XXXXXXXX owned by this process: the file beside
                         it, <path>.owner, is locked (flock) for as long as the process lives, and the kernel drops
                         that lock when the process ends, however it ends. First, every tupe-jax-<kind>-* folder
                         whose owner file's lock is free (its process has ended) is removed with that file. A
                         folder without an owner file (made by an older version) is left alone, as is one whose
                         owner file this user cannot open.
    remove(path)         removes the folder and its owner file, then gives up the lock
    sweep(kind)          the removal `make` does first; returns the folders removed

The owner file is made under a hidden name and renamed once its lock is held, so that another process's sweep never
sees an owner file that is not locked yet; it lies beside the folder, so that nothing but the staged files is
uploaded. The lock belongs to the open file, not to a process id: it holds across PID namespaces that share the
folder, and this process's own sweep is refused it too.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile

SUFFIX = ".owner"
_HELD: dict[str, tuple[int, str]] = {}     # folder -> (the descriptor holding its lock, the owner file)


def make(kind: str) -> str:
    """A new staging folder for `kind` (module docstring), after removing those of ended processes."""
    sweep(kind)
    fd, hidden = tempfile.mkstemp(prefix=f".tupe-jax-{kind}-", suffix=SUFFIX)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        owner = os.path.join(os.path.dirname(hidden), os.path.basename(hidden)[1:])
        os.rename(hidden, owner)
        path = owner[: -len(SUFFIX)]
        os.mkdir(path)
    except BaseException:
        os.close(fd)
        raise
    _HELD[path] = (fd, owner)
    return path


def remove(path: str) -> None:
    """Remove a folder `make` gave and its owner file, then release the lock (any folder: only removed)."""
    shutil.rmtree(path, ignore_errors=True)
    fd, owner = _HELD.pop(path, (None, ""))
    if fd is not None:
        _unlink(owner)
        os.close(fd)


def sweep(kind: str, root: str | None = None) -> list[str]:
    """Remove the tupe-jax-<kind>-* folders under `root` (default: the temporary folder) whose owner file's lock
    is free, with those files; returns the folders removed."""
    root = root or tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = sorted(n for n in os.listdir(root) if n.startswith(f"tupe-jax-{kind}-") and n.endswith(SUFFIX))
    except OSError:
        return removed
    for name in names:
        owner = os.path.join(root, name)
        try:
            fd = os.open(owner, os.O_RDONLY)
        except OSError:            # not this user's to open, or gone meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:            # held: its process is alive
            os.close(fd)
            continue
        try:
            path = owner[: -len(SUFFIX)]
            shutil.rmtree(path, ignore_errors=True)
            _unlink(owner)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
