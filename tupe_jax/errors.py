"""User-facing errors: one line, `error: <what>, <where>, <what to do>`.

Library code raises `UserError` for anything the user can fix (bad config key, missing file, malformed row,
input longer than a position table, ...). The launcher prints `str(err)` on one line and exits with status 2;
nothing else in the library catches it, so nothing written before the error is touched.
"""
from __future__ import annotations


class UserError(ValueError):
    """A problem with the user's input. `str(err)` is the complete one-line message."""

    def __init__(self, what: str, where: str = "", fix: str = ""):
        parts = [p.strip() for p in (what, where, fix) if p and p.strip()]
        message = "error: " + ", ".join(parts)
        super().__init__(message.replace("\n", " "))
        self.what, self.where, self.fix = what, where, fix


class Diverged(UserError):
    """Training met a non-finite loss, gradient or parameter (the trainer's); a comparison suite records the run as
    diverged and goes on (its comparisons get no verdict), other callers stop with the line."""


def require(condition: bool, what: str, where: str = "", fix: str = "") -> None:
    """Raise `UserError(what, where, fix)` unless `condition` holds."""
    if not condition:
        raise UserError(what, where, fix)


_WARNED: set[str] = set()


def warn_once(line: str) -> None:
    """Print `line` (a `warning: ...`) once per process: the launcher, a loop and a suite validate the same config."""
    if line not in _WARNED:
        _WARNED.add(line)
        print(line, flush=True)
