"""Host allocator setting for XLA:CPU: transparent huge pages for glibc malloc's large chunks.

XLA:CPU allocates an executable's temporary buffers afresh on every call. glibc serves any allocation above its
mmap threshold (at most 32 MiB) with a fresh `mmap`, and returns it to the kernel on `free`, so every training
step faults its whole working set in again, one 4 KiB page at a time: at the benchmark's equal-work shape
(4 layers, d 256, vocab 8192, batch 16 × 128) that is ~119,000 page faults per step and 30% of the step's CPU
time spent in the kernel. glibc ≥ 2.35 has a tunable that makes malloc `madvise(MADV_HUGEPAGE)` its mmap'd
chunks, `glibc.malloc.hugetlb=1`: the same buffers then fault in 2 MiB at a time (~1,000 faults per step), and
the step runs 1.39x faster (benchmarks/results_small_rounds.json, jobs bert_a@all and bert_a@all~4k). Numbers
are unchanged; only where the bytes live.

The tunable is read once, when the process starts, so `python -m launch` re-executes itself with it set
(`maybe_reexec`, called before anything heavy is imported; same PID, same argv). It is skipped when:
not Linux/glibc ≥ 2.35; the kernel's THP mode is `never`; GLIBC_TUNABLES already names
`glibc.malloc.hugetlb`; or `TUPE_JAX_HUGEPAGES=0` (the opt-out). The library itself never re-executes
anything: a Python program importing tupe_jax sets GLIBC_TUNABLES itself (`make test` does).

    tuned_environ(environ, libc, thp_mode) -> dict | None   the environment to re-execute with, or None
    maybe_reexec()                                          re-execute this process with it, if not None
"""
from __future__ import annotations

import os
import platform
import sys
from typing import Mapping, Optional

TUNABLE = "glibc.malloc.hugetlb"
SETTING = f"{TUNABLE}=1"
OPT_OUT = "TUPE_JAX_HUGEPAGES"          # "0": never re-execute
MARKER = "TUPE_JAX_REEXECUTED"          # set in the re-executed process: never twice
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
MIN_GLIBC = (2, 35)


def thp_mode(path: str = THP_ENABLED) -> str:
    """The kernel's transparent-huge-page mode (`always`, `madvise`, `never`), '' when unknown."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def _glibc(libc: tuple[str, str]) -> Optional[tuple[int, int]]:
    name, version = libc
    if name != "glibc":
        return None
    try:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def tuned_environ(environ: Mapping[str, str], libc: tuple[str, str], mode: str) -> Optional[dict[str, str]]:
    """The environment to re-execute with (`environ` plus the tunable), or None when nothing is to be done."""
    version = _glibc(libc)
    if environ.get(OPT_OUT) == "0" or environ.get(MARKER) or version is None or version < MIN_GLIBC:
        return None
    if mode == "never":
        return None
    current = environ.get("GLIBC_TUNABLES", "")
    if any(part.split("=")[0] == TUNABLE for part in current.split(":") if part):
        return None
    out = dict(environ)
    out["GLIBC_TUNABLES"] = f"{current}:{SETTING}" if current else SETTING
    out[MARKER] = "1"
    return out


def maybe_reexec() -> None:
    """Re-execute this Python process (same interpreter, flags and argv) with the tunable set, if it applies."""
    if not sys.platform.startswith("linux") or not sys.executable:
        return
    env = tuned_environ(os.environ, platform.libc_ver(), thp_mode())
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), env)
