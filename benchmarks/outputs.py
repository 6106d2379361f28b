"""Where a benchmark's results go: the output path is checked before any work, and the JSON lands whole or not at all.

    refuse_missing_folder(args.json)            right after parsing the arguments, before jax, torch or any timing
    write_json(args.json, result)               at the end (or after every row, for the scripts that write as they go)

A benchmark can run for minutes or, on a device machine, spend time that cannot be had back; a `--json` path whose
folder does not exist used to fail only at the end, losing the run. And a run cut off while writing (a timeout, a
Ctrl-C) used to leave half a file over the earlier result of the same name: `write_json` writes a temporary file
beside the result and renames it into place, so a reader sees the old file or the new one, never a mix.

Imports only the standard library (no jax, no torch), so the check costs nothing before a benchmark's heavy imports.
"""
from __future__ import annotations

import json
import os
import sys


def missing_folder(path: str, flag: str = "--json") -> str | None:
    """The refusal, without its 'error: ', for an output `path` given with `flag` whose folder does not exist; None
    when the folder exists or `path` is empty (the flag not given). For scripts that report errors their own way
    (pool_runs.py's Refused); the others call `refuse_missing_folder`."""
    if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        return f"no folder for {flag} {path!r}, {flag}, create the folder or name another"
    return None


def refuse_missing_folder(path: str, flag: str = "--json") -> None:
    """Exit (status 1, one line on stderr: 'error: no folder for --json ...') when `path`'s folder does not exist,
    so a mistyped output path costs a second instead of a whole run. Nothing happens for an empty `path`."""
    message = missing_folder(path, flag)
    if message:
        sys.exit(f"error: {message}")


def write_json(path: str, data, newline: bool = False, announce: bool = True) -> None:
    """`json.dump(data, f, indent=1)` to `path`, atomically: to a temporary file in the same folder, then
    `os.replace` onto `path` (a rename within one file system), so an interrupted write leaves the earlier file as it
    was; the temporary file is removed if the write fails. `newline` adds a final "\\n" (the scripts that wrote one
    before still do); `announce` prints 'wrote PATH' after the rename (off for a script that rewrites its file after
    every row, where one line per row would bury its own output)."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:      # plain open: the file gets the umask's mode, as before
            json.dump(data, f, indent=1)
            if newline:
                f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    if announce:
        print(f"wrote {path}", flush=True)
