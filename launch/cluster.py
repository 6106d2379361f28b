"""The multi-process flags of the launcher and `jax.distributed.initialize`.

Multi-process runs: run the SAME command on every host. On Cloud TPU pod slices, Slurm and Kubernetes (GKE)
`--distributed=on` calls `jax.distributed.initialize()` with no arguments and JAX detects the cluster; with the
default `--distributed=auto` this happens by itself on a Cloud TPU VM (TPU chips on the PCI bus: JAX then reads the
slice's workers from the VM's metadata server) and when `TPU_WORKER_HOSTNAMES` lists several hosts (GKE). Elsewhere
(e.g. several GPU machines) give `--coordinator_address=host:port --num_processes=N --process_id=i` or the
environment variables JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import signal

from tupe_jax.errors import UserError


def env_int(name: str) -> int | None:
    """The int in environment variable `name` (None when unset or empty); anything else is refused."""
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    text = value.strip()
    if not text.removeprefix("-").isdigit():      # one sign at most ("--2" is no int)
        raise UserError(f"environment variable {name}={value!r} is not an int", name, "unset it or give an int")
    return int(text)


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


def tpu_chips() -> int:
    """The TPU chips on this machine's PCI bus that JAX's Cloud TPU set-up would take this machine for a TPU VM by
    (libtpu installed, the metadata server not switched off, not one of several processes sharing the VM's chips);
    0 elsewhere. Found as JAX finds them, without starting a backend.

    A pod slice made with `gcloud compute tpus tpu-vm create` sets no environment variable that names its hosts
    (JAX asks the VM's metadata server), so `TPU_WORKER_HOSTNAMES` alone missed it: every host then trained without
    `jax.distributed` (no preemption notices, and Orbax's multi-host saves need its client)."""
    if importlib.util.find_spec("libtpu") is None or any(
            v in os.environ for v in ("TPU_SKIP_MDS_QUERY", "TPU_VISIBLE_CHIPS", "TPU_PROCESS_BOUNDS")):
        return 0
    try:
        from jax._src import hardware_utils  # pylint: disable=import-outside-toplevel
        return int(hardware_utils.num_available_tpu_chips_and_device_id()[0])
    except (ImportError, AttributeError, OSError):
        return 0


def maybe_initialize_distributed(args: argparse.Namespace) -> None:
    """Call `jax.distributed.initialize` when several processes are configured, or on a Cloud TPU VM (must
    precede device use)."""
    hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    explicit = (args.num_processes or 1) > 1 or bool(args.coordinator_address)
    if args.distributed == "off" or (args.distributed == "auto" and not explicit and len(hosts) <= 1
                                     and not tpu_chips()):
        return
    # only TPU chips said "auto": on a VM whose slice JAX cannot read (no metadata), stay one process; several
    # processes without jax.distributed are then refused (`refuse_undistributed_processes`)
    by_chips_alone = args.distributed == "auto" and not explicit and len(hosts) <= 1
    import jax  # pylint: disable=import-outside-toplevel
    try:
        if explicit:
            jax.distributed.initialize(coordinator_address=args.coordinator_address,
                                       num_processes=args.num_processes, process_id=args.process_id)
        else:
            jax.distributed.initialize()
    except (ValueError, RuntimeError, OSError) as err:   # no cluster found to fill in what the flags left out
        first = (str(err).strip().splitlines() or [""])[0][:200]
        if by_chips_alone:
            print(f"warning: jax.distributed did not start on this TPU VM ({first}); running as one process "
                  "(--distributed=on to stop instead)", flush=True)
            return
        raise UserError(f"jax.distributed.initialize: {first}", "--coordinator_address/--num_processes/--process_id",
                        "give all three, or run where JAX detects the cluster (a TPU pod, Slurm, GKE); on one "
                        "machine alone, --distributed=off") from None


def refuse_undistributed_processes() -> None:
    """Several processes without `jax.distributed` (a TPU pod run with --distributed=off, or one JAX's TPU runtime
    joined by itself) are refused: each process would decide a preemption, a checkpoint fallback or a lock alone,
    and Orbax's multi-host saves need the distributed client."""
    import jax  # pylint: disable=import-outside-toplevel
    if jax.process_count() > 1 and not jax.distributed.is_initialized():
        raise UserError(f"{jax.process_count()} processes without jax.distributed", "--distributed",
                        "run with --distributed=on (or auto) on every host")


CLUSTER_FLAGS = ("distributed", "coordinator_address", "num_processes", "process_id")   # differ by process
READS_RUNS = ("evaluate", "extrapolate", "probe", "correlations", "shuffle-attention", "export")


def agree_on_command(args: argparse.Namespace) -> None:
    """Several processes (`jax.distributed`), a command without a config (`evaluate`, the analyses, `export`, ...):
    they stop together, each with one line, if they were given different command lines, or if a `--workdir` the
    command reads is not a run on some process (a process that stopped alone would leave the others waiting at
    JAX's next collective call: `workdir.claim.agree`), or if another corpus (`--config.data.*`) is refused on some
    process (a prepared directory one host lacks). SIGTERM then ends `evaluate`, an analysis or `export` at
    once, as it does one process: jax.distributed's preemption notifier would take the signal, and only the training
    loops act on it."""
    import jax  # pylint: disable=import-outside-toplevel
    if not jax.distributed.is_initialized() or jax.process_count() == 1:
        return
    if args.command in READS_RUNS:      # not `demo`, which trains: its loop acts on jax.distributed's notice
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from tupe_jax import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
    workdirs = args.workdir if isinstance(args.workdir, list) else [args.workdir]
    failure = None
    try:
        if args.command in READS_RUNS:
            for workdir in workdirs:
                config = workdir_lib.read_config(workdir)
                if getattr(args, "data", None):       # another corpus: every process must be able to read it
                    workdir_lib.corpus_config(config, args.data, workdir)
    except Exception as err:  # pylint: disable=broad-except  # shared with the other processes by `agree`
        failure = err
    given = {f"--{k}": repr(v) for k, v in sorted(vars(args).items()) if k not in CLUSTER_FLAGS + ("data",)}
    given.update({f"--config.{k}": repr(v) for k, v in (getattr(args, "data", None) or {}).items()})
    workdir_lib.agree(str(workdirs[0] or "."), failure, "", stage="command", same=given)
