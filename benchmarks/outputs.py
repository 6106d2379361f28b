"""Where a benchmark's results go: the output path is checked before any work, and the JSON lands whole or not at all.

    refuse_missing_folder(args.json)            right after parsing the arguments, before jax, torch or any timing
    refuse_below(args, rounds=1, steps=1)       the counts a run cannot do without, checked at the same place
    write_json(args.json, result)               at the end (or after every row, for the scripts that write as they go)

A benchmark can run for minutes or, on a device machine, spend time that cannot be had back; a `--json` path whose
folder does not exist used to fail only at the end, losing the run. And a run cut off while writing (a timeout, a
Ctrl-C) used to leave half a file over the earlier result of the same name: `write_json` writes a temporary file
beside the result and renames it into place, so a reader sees the old file or the new one, never a mix.

A result also says where it came from: `write_json` adds an "environment" entry to a dict that has none (the
command line, the checkout's commit, the CPU, the Python and package versions, and the environment variables that
change a step's speed: GLIBC_TUNABLES, XLA_FLAGS, TUPE_JAX_ONEDNN and the thread counts), so a JSON can be rerun
as it was made.

Imports only the standard library (no jax, no torch), so the check costs nothing before a benchmark's heavy imports.
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata

# the environment variables that change what a benchmark measures (recorded by `environment`)
# (the malloc too: a preloaded library, oneTBB's setting, the launcher's choice; tupe_jax/allocator.py)
SPEED_VARIABLES = ("GLIBC_TUNABLES", "XLA_FLAGS", "TUPE_JAX_ONEDNN", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                   "JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES", "LD_PRELOAD", "TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD",
                   "TUPE_JAX_ALLOCATOR", "TUPE_JAX_HUGEPAGES")
PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy", "torch", "transformers")


def missing_folder(path: str, flag: str = "--json") -> str | None:
    """The refusal, without its 'error: ', for an output `path` given with `flag` that cannot be written: its folder
    does not exist, or `path` is itself a folder. None when it can be, or when `path` is empty (the flag not given).
    For scripts that report errors their own way (pool_runs.py's Refused); the others call
    `refuse_missing_folder`."""
    if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        return f"no folder for {flag} {path!r}, {flag}, create the folder or name another"
    if path and os.path.isdir(path):
        return f"{flag} {path!r} is a folder, {flag}, name a file (for example {os.path.join(path, 'result.json')!r})"
    return None


def refuse_missing_folder(path: str, flag: str = "--json") -> None:
    """Exit (status 1, one line on stderr: 'error: no folder for --json ...') when `path` cannot be written
    (`missing_folder`), so a mistyped output path costs a second instead of a whole run. Nothing happens for an
    empty `path`."""
    message = missing_folder(path, flag)
    if message:
        sys.exit(f"error: {message}")


def refuse_below(args, **lowest: int) -> None:
    """Exit (status 1, one line) when a count in `args` is below its lowest value, e.g. `rounds=1, steps=1`: zero
    rounds or steps used to run the heavy part and then fail in a median of nothing (or write a JSON of errors)."""
    for name, low in lowest.items():
        value = getattr(args, name)
        if value < low:
            sys.exit(f"error: --{name} {value} is below {low}, --{name}, give {low} or more")


def refuse_unknown(flag: str, given: list[str], known, what: str) -> None:
    """Exit (status 1, one line) when a name in `given` (a comma list's items) is not in `known`; `what` says what
    the names are ('schemes', 'peers')."""
    unknown = [g for g in given if g not in known]
    if unknown:
        sys.exit(f"error: unknown {what} {', '.join(map(repr, unknown))}, {flag}, use some of "
                 f"{','.join(known)}")


def refuse_failed(failed: dict, path: str) -> None:
    """Exit (status 1, one line) when a job failed in every round (`failed`: job -> its error lines), leaving the
    JSON at `path` as it was: a result of errors would replace a good one of the same name, with exit status 0."""
    def last_line(error) -> str:         # a job's error: a line, or (nested) lists of its rounds' lines
        while isinstance(error, list) and error:
            error = error[-1]
        return str(error or "no message")[-300:]

    if failed:
        name, error = next(iter(failed.items()))
        sys.exit(f"error: {len(failed)} job(s) failed in every round ({', '.join(failed)}; {name}: "
                 f"{last_line(error)}), the benchmark's jobs, see the table above"
                 + (f"; {path} was left as it was" if path else ""))


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0 or not done.stdout.strip():
        return None
    status = subprocess.run(["git", "status", "--porcelain"], cwd=os.path.dirname(os.path.abspath(__file__)),
                            capture_output=True, text=True, timeout=10, check=False)
    return done.stdout.strip() + ("+dirty" if status.returncode != 0 or status.stdout.strip() else "")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """Where a result was made: the command line, the commit, the CPU and its core count, Python and the packages'
    versions (None: not installed), and the speed-changing environment variables that were set."""
    return {"command": "python " + shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:]) if sys.argv[0] else None,
            "git_commit": _commit(), "cpu": _cpu(), "cpu_count": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "python": platform.python_version(), "packages": {p: _version(p) for p in PACKAGES},
            "variables": {v: os.environ[v] for v in SPEED_VARIABLES if v in os.environ}}


def write_json(path: str, data, newline: bool = False, announce: bool = True) -> None:
    """`json.dump(data, f, indent=1)` to `path`, atomically: to a temporary file in the same folder, then
    `os.replace` onto `path` (a rename within one file system), so an interrupted write leaves the earlier file as it
    was; the temporary file is removed if the write fails. `newline` adds a final "\\n" (the scripts that wrote one
    before still do); `announce` prints 'wrote PATH' after the rename (off for a script that rewrites its file after
    every row, where one line per row would bury its own output). A dict without an "environment" entry gets one
    (`environment`)."""
    if isinstance(data, dict) and "environment" not in data:
        data = {**data, "environment": environment()}
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
