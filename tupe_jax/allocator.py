"""Host allocator for XLA:CPU: a malloc that keeps a step's large buffers, else huge pages for glibc's.

XLA:CPU allocates an executable's temporary buffer afresh on every call. glibc serves any allocation above its
mmap threshold (at most 32 MiB) with a fresh `mmap`, and returns it to the kernel on `free`, so every training
step faults its whole working set in again and the kernel zeroes it: at the benchmark's equal-work shape (4 layers,
d 256, vocab 8192, batch 16 × 128) ~119,000 page faults of 4 KiB per step, 30% of the step's CPU time in the
kernel. `python -m launch` re-executes itself (`maybe_reexec`, before anything heavy is imported; same PID, same
argv) with one of two settings, the first that applies:

- `tbbmalloc`: oneTBB's scalable allocator (the `tbb` wheel, Linux x86_64) preloaded in place of malloc, with
  every freed block of 1 MiB or more kept for the next allocation of its size (`TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD`).
  The step's buffer is then mapped once per process: a few hundred page faults per step against ~800 with huge
  pages (one process in seven still had ~9,000), and none of the stalls of a second or more in the kernel that
  fresh mappings meet on some virtual machines. The step ran 1.11x (equal work) and 1.13x (default head) faster
  than with huge pages by the median step, 1.19x and 1.39x by the mean; the process holds what it freed, so its
  peak resident memory was 42% higher (benchmarks/results_allocator_tbb_xeon_m167_s46.json). Applies, unless
  named, where JAX will run on the CPU: no JAX accelerator plugin installed (libtpu, a CUDA or ROCm plugin), or
  `JAX_PLATFORMS=cpu`; and `LD_PRELOAD` unset (a malloc the user preloads, tcmalloc on a TPU VM say, is kept).
  Measured on CPUs only.
- `hugepages`: glibc ≥ 2.35's tunable `glibc.malloc.hugetlb=1` (transparent huge pages not `never`): malloc
  `madvise(MADV_HUGEPAGE)`s its mmap'd chunks, and the same buffers fault in 2 MiB at a time (~1,000 faults per
  step; the step ran 1.39x faster than with 4 KiB pages, benchmarks/results_small_rounds.json). Not applied when
  GLIBC_TUNABLES already names the tunable.

Numbers are unchanged either way; only where the bytes live. `TUPE_JAX_ALLOCATOR` chooses: unset or `auto` (the
first that applies), `tbbmalloc` or `hugepages` (that one, or a one-line error where it cannot apply), `system`
(neither); `TUPE_JAX_HUGEPAGES=0`, the older opt-out, is `system`. A process already re-executed (`MARKER`) is
never re-executed again. The library itself never re-executes anything: a Python program importing tupe_jax sets
its environment itself (`make test` sets the glibc tunable for pytest).

    choose(environ, libc, thp_mode, tbb_libs, plugin) -> 'tbbmalloc' | 'hugepages' | ''   what applies ('' none)
    why_not(setting, environ, libc, thp_mode, tbb_libs, plugin) -> str  why a setting cannot apply ('' it can)
    tuned_environ(environ, libc, thp_mode, tbb_libs=None, plugin='') -> dict | None   the environment to re-execute
                                                                        with, or None
    active(environ=None) -> 'tbbmalloc' | 'hugepages' | 'system'        what this process runs with (provenance)
    tbbmalloc_libs() -> (libtbbmalloc, its proxy) paths | None          from the installed `tbb` wheel
    accelerator_plugin() -> str                                         an installed JAX accelerator plugin, or ''
    maybe_reexec()                                                      re-execute this process, if one applies
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
from typing import Mapping, Optional

from tupe_jax.errors import UserError

TUNABLE = "glibc.malloc.hugetlb"
SETTING = f"{TUNABLE}=1"
CHOICE = "TUPE_JAX_ALLOCATOR"           # auto (or unset), tbbmalloc, hugepages, system
CHOICES = ("auto", "tbbmalloc", "hugepages", "system")
OPT_OUT = "TUPE_JAX_HUGEPAGES"          # "0": the older opt-out, as TUPE_JAX_ALLOCATOR=system
MARKER = "TUPE_JAX_REEXECUTED"          # set in the re-executed process: never twice
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
MIN_GLIBC = (2, 35)
TBB_LIBS = ("libtbbmalloc.so.2", "libtbbmalloc_proxy.so.2")   # the proxy needs the allocator loaded first
TBB_KEEP = {"TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD": str(1 << 20)}  # freed blocks ≥ 1 MiB stay with the process
PLUGINS = ("xla_cuda", "xla_rocm")      # jax_plugins.<name> prefixes of JAX's GPU plugins
# every variable a setting reads or writes: what a caller clears to start from the system's malloc
SETTINGS_ENV = ("GLIBC_TUNABLES", "LD_PRELOAD", CHOICE, OPT_OUT, MARKER, *TBB_KEEP)


def thp_mode(path: str = THP_ENABLED) -> str:
    """The kernel's transparent-huge-page mode (`always`, `madvise`, `never`), '' when unknown."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def tbbmalloc_libs() -> Optional[tuple[str, str]]:
    """The installed `tbb` wheel's libtbbmalloc and libtbbmalloc_proxy (absolute paths), None where it is not
    installed or lacks them."""
    try:
        files = importlib.metadata.files("tbb") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = {f.name: str(f.locate()) for f in files if f.name in TBB_LIBS}
    paths = tuple(os.path.abspath(found[name]) for name in TBB_LIBS if name in found)
    return paths if len(paths) == 2 and all(os.path.isfile(p) for p in paths) else None  # type: ignore[return-value]


def accelerator_plugin() -> str:
    """The name of an installed JAX accelerator plugin (`libtpu`, `jax_plugins.xla_cuda12`, ...), '' where none
    (looked up, not imported)."""
    if importlib.util.find_spec("libtpu") is not None:
        return "libtpu"
    spec = importlib.util.find_spec("jax_plugins")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        for name in names:
            if name.startswith(PLUGINS):
                return f"jax_plugins.{name}"
    return ""


def _glibc(libc: tuple[str, str]) -> Optional[tuple[int, int]]:
    name, version = libc
    if name != "glibc":
        return None
    try:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def _setting(environ: Mapping[str, str]) -> str:
    """TUPE_JAX_ALLOCATOR checked (UserError for another value), with the older opt-out read as `system`."""
    value = environ.get(CHOICE, "") or "auto"
    if value not in CHOICES:
        raise UserError(f"{CHOICE}={value!r} is not one of {', '.join(CHOICES)}", "the environment",
                        f"set {CHOICE} to one of them or unset it (tupe_jax/allocator.py)")
    if value == "auto" and environ.get(OPT_OUT) == "0":
        return "system"
    return value


def why_not(setting: str, environ: Mapping[str, str], libc: tuple[str, str], mode: str,
            tbb_libs: Optional[tuple[str, str]], plugin: str) -> str:
    """Why `setting` ('tbbmalloc' or 'hugepages') cannot apply here, '' where it can."""
    if setting == "tbbmalloc":
        if tbb_libs is None:
            return "the tbb wheel (oneTBB's libtbbmalloc) is not installed"
        if environ.get("LD_PRELOAD", "").strip():
            return "LD_PRELOAD is already set"
        if plugin and environ.get("JAX_PLATFORMS", "").strip().lower() != "cpu":
            return f"JAX may run on an accelerator ({plugin} is installed; JAX_PLATFORMS=cpu says it will not)"
        return ""
    if libc[0] != "glibc":
        return f"the C library is not glibc, which has {TUNABLE}"
    version = _glibc(libc)
    if version is None or version < MIN_GLIBC:
        return f"glibc {libc[1]} has no {TUNABLE} (it came in 2.35)"
    if mode == "never":
        return "the kernel's transparent huge pages are 'never'"
    if any(part.split("=")[0] == TUNABLE for part in environ.get("GLIBC_TUNABLES", "").split(":") if part):
        return f"GLIBC_TUNABLES already sets {TUNABLE}"
    return ""


def choose(environ: Mapping[str, str], libc: tuple[str, str], mode: str,
           tbb_libs: Optional[tuple[str, str]], plugin: str) -> str:
    """The setting to re-execute with: 'tbbmalloc', 'hugepages' or '' (none: opted out, already re-executed,
    nothing applies). A setting named in TUPE_JAX_ALLOCATOR that cannot apply is a UserError; named, tbbmalloc
    applies with an accelerator plugin installed too (the user chose it for that host)."""
    setting = _setting(environ)
    if setting == "system" or environ.get(MARKER):
        return ""
    plugin = plugin if setting == "auto" else ""
    blockers = {name: why_not(name, environ, libc, mode, tbb_libs, plugin) for name in ("tbbmalloc", "hugepages")}
    if setting != "auto":
        if blockers[setting]:
            raise UserError(f"{CHOICE}={setting} cannot apply: {blockers[setting]}", "the environment",
                            f"set {CHOICE}=auto (the first that applies) or system (neither)")
        return setting
    return next((name for name, blocker in blockers.items() if not blocker), "")


def tuned_environ(environ: Mapping[str, str], libc: tuple[str, str], mode: str,
                  tbb_libs: Optional[tuple[str, str]] = None, plugin: str = "") -> Optional[dict[str, str]]:
    """The environment to re-execute with (`environ` plus the chosen setting and `MARKER`), or None when nothing is
    to be done (`choose`)."""
    setting = choose(environ, libc, mode, tbb_libs, plugin)
    if not setting:
        return None
    out = dict(environ)
    if setting == "tbbmalloc":
        out["LD_PRELOAD"] = ":".join(tbb_libs or ())
        out.update(TBB_KEEP)
    else:
        current = environ.get("GLIBC_TUNABLES", "")
        out["GLIBC_TUNABLES"] = f"{current}:{SETTING}" if current else SETTING
    out[MARKER] = "1"
    return out


def active(environ: Optional[Mapping[str, str]] = None) -> str:
    """What this process's malloc is (read from its environment): 'tbbmalloc' where the proxy is preloaded,
    'hugepages' where glibc's tunable is 1, else 'system'."""
    environ = os.environ if environ is None else environ
    if TBB_LIBS[1] in environ.get("LD_PRELOAD", ""):
        return "tbbmalloc"
    if SETTING in environ.get("GLIBC_TUNABLES", "").split(":"):
        return "hugepages"
    return "system"


def maybe_reexec() -> None:
    """Re-execute this Python process (same interpreter, flags and argv) with the chosen setting, if one applies.
    A TUPE_JAX_ALLOCATOR that is invalid or cannot apply exits with its one-line error (status 2)."""
    if not sys.platform.startswith("linux") or not sys.executable:
        return
    try:
        env = tuned_environ(os.environ, platform.libc_ver(), thp_mode(), tbbmalloc_libs(), accelerator_plugin())
    except UserError as err:
        print(err, file=sys.stderr, flush=True)
        sys.exit(2)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), env)
