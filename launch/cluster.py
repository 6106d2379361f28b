"""The multi-process flags of the launcher and `jax.distributed.initialize`.

Multi-process runs: run the SAME command on every host. On Cloud TPU pod slices, Slurm and Kubernetes (GKE)
`--distributed=on` calls `jax.distributed.initialize()` with no arguments and JAX detects the cluster; with the
default `--distributed=auto` this happens by itself when `TPU_WORKER_HOSTNAMES` lists several hosts. Elsewhere
(e.g. several GPU machines) give `--coordinator_address=host:port --num_processes=N --process_id=i` or the
environment variables JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID.
"""
from __future__ import annotations

import argparse
import os

from tupe_jax.errors import UserError


def env_int(name: str) -> int | None:
    """The int in environment variable `name` (None when unset or empty); anything else is refused."""
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    if not value.strip().lstrip("-").isdigit():
        raise UserError(f"environment variable {name}={value!r} is not an int", name, "unset it or give an int")
    return int(value)


def check_processes(args: argparse.Namespace) -> None:
    """The multi-process flags (or JAX_* variables) must describe one consistent cluster; refused before JAX."""
    n, i = args.num_processes, args.process_id
    where = "--num_processes/--process_id (or JAX_NUM_PROCESSES/JAX_PROCESS_ID)"
    if n is not None and n < 1:
        raise UserError(f"--num_processes={n} is not a process count", where, "give N >= 1, or leave it out")
    if i is not None and (n is None or not 0 <= i < n):
        raise UserError(f"--process_id={i} without --num_processes > {i}" if n is None or i >= 0 else
                        f"--process_id={i} is negative", where, "give --num_processes=N and 0 <= --process_id < N")
    if args.distributed == "off" and ((n or 1) > 1 or args.coordinator_address):
        raise UserError("--distributed=off contradicts the multi-process flags given", "--distributed",
                        "drop --distributed=off, or the --coordinator_address/--num_processes/--process_id flags")


def maybe_initialize_distributed(args: argparse.Namespace) -> None:
    """Call `jax.distributed.initialize` when several processes are configured (must precede device use)."""
    hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    explicit = (args.num_processes or 1) > 1 or bool(args.coordinator_address)
    if args.distributed == "off" or (args.distributed == "auto" and not explicit and len(hosts) <= 1):
        return
    import jax  # pylint: disable=import-outside-toplevel
    try:
        if explicit:
            jax.distributed.initialize(coordinator_address=args.coordinator_address,
                                       num_processes=args.num_processes, process_id=args.process_id)
        else:
            jax.distributed.initialize()
    except ValueError as err:   # JAX found no cluster to fill in what the flags left out
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise UserError(f"jax.distributed.initialize: {first}", "--coordinator_address/--num_processes/--process_id",
                        "give all three, or run where JAX detects the cluster (a TPU pod, Slurm, GKE)") from None
