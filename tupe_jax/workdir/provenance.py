"""Provenance: every command that claims a run folder appends one row to `provenance.jsonl` — when, the full command
line, the git commit of this checkout (when there is one), the CPU, the package versions, the devices and processes,
and the library the steps' dots use (`xla_options.dot_library`: it decides float rounding on an x86 CPU).

A run resumed on another machine, JAX or commit therefore says so in its own folder.
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from importlib import metadata

import jax

from tupe_jax import allocator, files, host, xla_options

NAME = "provenance.jsonl"
PACKAGES = ("tupe-jax", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "grain", "tensorflow-datasets",
            "tokenizers", "etils", "gcsfs", "libtpu", "jax-cuda12-plugin", "tbb")


def git_commit() -> str:
    """The commit of the checkout this package runs from ('' outside a git checkout; '+dirty' with changes)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return commit + ("+dirty" if dirty else "")


def versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def describe() -> dict:
    """The row for this process, now."""
    devices = jax.devices()
    return {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), "cwd": os.getcwd(), "git_commit": git_commit(),
            "python": platform.python_version(), "host": platform.node(), "cpu": host.cpu_description(),
            "packages": versions(),
            "devices": {"platform": devices[0].platform, "kind": devices[0].device_kind, "count": len(devices),
                        "local_count": jax.local_device_count()},
            "process_count": jax.process_count(), "allocator": allocator.active(),
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""), "dot_library": xla_options.dot_library()}


def record(workdir: str) -> None:
    """Append this command's row to `workdir/provenance.jsonl` (`workdir.claim` calls it once per command)."""
    files.append_text(files.join(workdir, NAME), files.to_json(describe(), indent=None, sort_keys=False) + "\n")
