"""What a failed command undoes in its run folder: `Before.take(workdir)` just before `claim` writes anything,
`before.undo()` after the command failed (a UserError or anything unexpected, not an interrupt), while it still holds
the folder's lock (another launch could otherwise claim the folder first and lose its new files), then
`before.remove_new_folders()` once the lock is released.

A command that produced nothing worth keeping — no new committed checkpoint step, no new results file — leaves the
folder as it found it: what it created at the top level (config.json, tokenizer/, metrics, ...) and in an existing
tensorboard/ is removed, and the files `claim` rewrites or appends to in an existing run (config.json,
config_history.jsonl, provenance.jsonl) get their earlier text back. So a resume refused late, by a check that
needs the restored state (the data iterator's settings, a prepared corpus's tokenizer), changes nothing on disk.
A command that did produce checkpoints or results keeps everything: its config and provenance rows describe them.
`.lock` (the lock's own business) and `logs/` (the traceback an error line points at) are never removed.

`staging_folder(target)`: a folder that is made whole before it appears (an export, an import) is written under
`.NAME.HOST.PID.tmp` beside it and renamed; what a killed process of this host left there is removed first.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import socket
from typing import Optional

from tupe_jax import files
from tupe_jax.checkpoint import committed
from tupe_jax.workdir.gate import HISTORY, RESULTS
from tupe_jax.workdir.lock import LOCK_NAME
from tupe_jax.workdir.provenance import NAME as PROVENANCE

REWRITTEN = ("config.json", HISTORY, PROVENANCE)   # what `claim` writes into a folder that already holds a run
KEEP = (LOCK_NAME, "logs")


def _names(path: str) -> set[str]:
    return set(files.listdir(path)) if files.isdir(path) else set()


def _steps(workdir: str) -> set[str]:
    """The committed checkpoint steps (not Orbax's unfinished saves: `checkpoint.committed`)."""
    folder = files.join(workdir, "checkpoints")
    return {name for name in _names(folder) if name.isdigit() and committed(files.join(folder, name))}


def holds_results(path: str) -> bool:
    """True if `path` is a results file or holds, at any depth (a sweep's or a suite's runs are folders in it), a
    committed checkpoint step or a results file: worth keeping after an error."""
    if files.isfile(path):
        return os.path.basename(path) in RESULTS
    for root, dirs, names in files.walk(path):
        if os.path.basename(root) == "checkpoints" and any(d.isdigit() and committed(files.join(root, d))
                                                           for d in dirs):
            return True
        if set(RESULTS) & set(names):
            return True
    return False


def _remove(path: str) -> None:
    if (files.is_remote(path) or not os.path.islink(path)) and files.isdir(path):
        files.rmtree(path)
        return
    with contextlib.suppress(OSError):
        files.remove(path)


@dataclasses.dataclass(frozen=True)
class Before:
    """A run folder as a command found it: its top-level entries (None: no folder), the text of the files `claim`
    rewrites (None: absent), its committed checkpoint steps and its tensorboard/ entries."""
    workdir: str
    names: Optional[frozenset[str]]
    texts: dict[str, Optional[str]]
    steps: frozenset[str]
    events: frozenset[str]
    parents: tuple[str, ...] = ()   # local folders above a new workdir that did not exist either (deepest first)

    @classmethod
    def take(cls, workdir: str) -> "Before":
        if not files.isdir(workdir):
            # the path as written (`mkdir -p` of `n1/../n2/run` makes `n1` too); `n1/..` itself is never empty
            parents, up = [], os.path.dirname(workdir.rstrip(os.sep))
            while not files.is_remote(workdir) and up and up != os.path.dirname(up) and not os.path.exists(up):
                parents, up = parents + [up], os.path.dirname(up)
            return cls(workdir, None, {}, frozenset(), frozenset(), tuple(parents))
        names = frozenset(files.listdir(workdir))
        texts = {name: files.read_text(files.join(workdir, name)) if name in names else None for name in REWRITTEN}
        return cls(workdir, names, texts, frozenset(_steps(workdir)),
                   frozenset(_names(files.join(workdir, "tensorboard"))))

    def new_entries(self) -> list[str]:
        return sorted(_names(self.workdir) - (self.names or set()) - set(KEEP))

    def produced(self) -> bool:
        """Whether the command left something worth keeping: a new checkpoint step or results."""
        return bool(_steps(self.workdir) - self.steps) or any(
            holds_results(files.join(self.workdir, name)) for name in self.new_entries())

    def undo(self) -> None:
        """Put the folder back as it was, unless the command produced checkpoints or results (module doc)."""
        if not files.isdir(self.workdir) or self.produced():
            return
        for name in self.new_entries():
            _remove(files.join(self.workdir, name))
        if self.names is None:
            return
        events = files.join(self.workdir, "tensorboard")
        for name in sorted(_names(events) - self.events) if "tensorboard" in self.names else ():
            _remove(files.join(events, name))
        for name, text in self.texts.items():
            path = files.join(self.workdir, name)
            if text is None:
                if files.exists(path):
                    files.remove(path)
            elif not files.isfile(path) or files.read_text(path) != text:
                files.write_text(path, text)

    def remove_new_folders(self) -> None:
        """After `undo`, once the lock is released (its file is in the folder until then): the local folder of a new
        run and those `mkdir -p` made above it, each if it is empty."""
        for folder in (self.workdir, *self.parents) if self.names is None and not files.is_remote(self.workdir) else ():
            if os.path.isdir(folder) and not os.listdir(folder):
                os.rmdir(folder)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # another user's process
        return True
    return True


def staging_folder(target: str, what: str) -> str:
    """A new, empty hidden folder beside the local folder `target` (`.NAME.HOST.PID.tmp`), to be renamed onto it when
    complete. Folders of that form from this host whose process is gone (a `kill -9` during an export or an import)
    are removed first, each with a line naming `what` they were; another host's, on a shared disk, are left."""
    parent, name = os.path.split(os.path.abspath(target))
    host = socket.gethostname()
    os.makedirs(parent, exist_ok=True)
    pattern = re.compile(rf"\.{re.escape(name)}\.{re.escape(host)}\.(\d+)\.tmp")
    for entry in os.listdir(parent):
        match = pattern.fullmatch(entry)
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
            print(f"removed {os.path.join(parent, entry)}, the unfinished {what} of a stopped process", flush=True)
    staging = os.path.join(parent, f".{name}.{host}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    return staging
