"""What a failed checkpoint read reports, and the leftovers of it that must not reach stderr.

`describe(err)` is "<Type>: <first line>" of the error at the root of `err`'s explicit cause chain (`raise ... from
...`), cut to 300 characters. Orbax wraps tensorstore's error ("OUT_OF_RANGE: Error reading ... in OCDBT database at
...: Requested byte range ... is not valid") in a generic "Encountered error while reading array index" whose first
line names only array slices; the root names the file and what is wrong with it.

`quiet_leftovers()` is called before any checkpoint is opened (a failed read's leftovers may arrive, on other
threads, before its error reaches the caller). Once a restore has failed, Orbax's other reads of that step are still
in flight and end later: on tensorstore's threads, as callbacks posted to the event loop Orbax already closed, or
when the garbage collector closes their coroutines. Python prints each as an "Exception ignored in ..." traceback on
stderr (hundreds of lines for a checkpoint that lost its manifest), after our one line that said which step failed
and what happens next; asyncio logs the futures whose failures nobody collected ("... exception was never
retrieved"). The process drops exactly these three leftovers, and passes everything else on (`sys.unraisablehook` to
the hook it replaced; asyncio's logger unchanged):
- a RuntimeError 'Event loop is closed' raised in asyncio's `call_soon_threadsafe`;
- an Orbax coroutine that raised while being closed (GeneratorExit in its exception's chain);
- asyncio's "exception was never retrieved" record of a checkpoint read's error (raised in Orbax's code, or by
  tensorstore, whose errors carry its `tensorstore_spec` or name the checkpoint's "OCDBT database").
"""
from __future__ import annotations

import inspect
import logging
import sys
import traceback
from typing import Any

_INSTALLED = {"done": False}
_TENSORSTORE = ("tensorstore_spec", "in OCDBT database")   # how tensorstore's errors of a checkpoint read end


def root_cause(err: BaseException) -> BaseException:
    """The last exception of `err.__cause__`, `err.__cause__.__cause__`, ... (`err` itself if it has none)."""
    seen = {id(err)}
    while err.__cause__ is not None and id(err.__cause__) not in seen:
        err = err.__cause__
        seen.add(id(err))
    return err


def describe(err: BaseException, limit: int = 300) -> str:
    """'<Type>: <first line>' of `err`'s root cause, at most `limit` characters of the line."""
    root = root_cause(err)
    lines = str(root).strip().splitlines()
    return f"{type(root).__name__}: {lines[0][:limit]}" if lines else type(root).__name__


def _chain(err: BaseException | None) -> list[BaseException]:
    out: list[BaseException] = []
    while err is not None and all(err is not e for e in out):
        out.append(err)
        err = err.__cause__ or err.__context__
    return out


def is_leftover(unraisable: Any) -> bool:
    """Whether an unraisable exception (`sys.UnraisableHookArgs`) is one of a failed read's leftovers (module
    docstring)."""
    exc, obj = unraisable.exc_value, unraisable.object
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
        frames = traceback.extract_tb(unraisable.exc_traceback) if unraisable.exc_traceback else []
        return any(f.name == "call_soon_threadsafe" for f in frames)
    if inspect.iscoroutine(obj) and "orbax" in getattr(obj.cr_code, "co_filename", ""):
        return any(isinstance(e, GeneratorExit) for e in _chain(exc))
    return False


def _from_a_checkpoint_read(err: BaseException) -> bool:
    for e in _chain(err):
        frames = traceback.extract_tb(e.__traceback__) if e.__traceback__ else []
        if any(mark in str(e) for mark in _TENSORSTORE) or any("orbax" in f.filename for f in frames):
            return True
    return False


class _DropUnretrieved(logging.Filter):
    """asyncio's "exception was never retrieved" records of a checkpoint read's errors (module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        return not ("exception was never retrieved" in str(record.msg) and err is not None
                    and _from_a_checkpoint_read(err))


def quiet_leftovers() -> None:
    """Drop failed reads' leftovers from now on (module docstring); idempotent."""
    if _INSTALLED["done"]:
        return
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not is_leftover(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_DropUnretrieved())
    _INSTALLED["done"] = True
