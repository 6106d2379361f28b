"""What a failed checkpoint write means and what it leaves: `is_disk_full(err)` (the disk, quota or file-size limit
is full: tensorstore reports it as ValueError text carrying the OS error code, Python as OSError), `full_reason`,
and `remove_when_quiet(path)` for the unfinished step folder of a failed save.
"""
from __future__ import annotations

import errno
import os
import time

from tupe_jax import files

# Write failures that mean "the disk (or quota, or file-size limit) is full". Tensorstore reports them as
# ValueError text carrying the OS error code, Python writes as OSError.
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_FULL_TEXT = ("no space left on device", "disk quota exceeded", "file too large") + tuple(
    f"os_error_code='{code}'" for code in _FULL_ERRNOS)


def is_disk_full(err: BaseException) -> bool:
    """True if `err` (or an exception it wraps) is a write that failed for lack of space."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _FULL_ERRNOS:
            return True
        if any(t in str(err).lower() for t in _FULL_TEXT):
            return True
        err = err.__cause__ or err.__context__
    return False


def _snapshot(path: str) -> list:
    """What is under `path` now (names and sizes; [] for a bucket path or nothing)."""
    if files.is_remote(path) or not os.path.isdir(path):
        return []
    return sorted((os.path.join(root, n), os.path.getsize(os.path.join(root, n)))
                  for root, _, names in os.walk(path) for n in names if os.path.exists(os.path.join(root, n)))


def full_reason(err: BaseException) -> str:
    """The words of `err` that say what is full ("disk full" when none do)."""
    return next((t for t in _FULL_TEXT if t in str(err).lower()), "disk full")


def remove_when_quiet(path: str, settle: float = 0.5, limit: float = 30.0) -> None:
    """Remove the unfinished step folder `path` once nothing has written to it for `settle` seconds: after a
    failed save, tensorstore's array writers may still be landing (and would recreate a folder removed earlier)."""
    deadline, last = time.time() + limit, None
    while time.time() < deadline:
        now = _snapshot(path)
        if now == last:
            break
        last = now
        time.sleep(settle)
    if files.isdir(path):
        files.rmtree(path)
