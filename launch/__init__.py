"""`python -m launch <command> --config=configs/X.py:arg --workdir=DIR [--config.a.b=c ...]`.

Short by design: parse flags, load + override + validate the config, initialise multi-process JAX if asked, and
dispatch to a library function (imported lazily). Any `UserError` becomes one line `error: ...` on stderr, exit 2.

Multi-process runs: run the SAME command on every host. On Cloud TPU pod slices, Slurm and Kubernetes (GKE)
`--distributed=on` calls `jax.distributed.initialize()` with no arguments and JAX detects the cluster; with the
default `--distributed=auto` this happens by itself when `TPU_WORKER_HOSTNAMES` lists several hosts. Elsewhere
(e.g. several GPU machines) give `--coordinator_address=host:port --num_processes=N --process_id=i` or the
environment variables JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from typing import Any, Callable, Sequence

from tupe_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Command:
    """A launcher command: the library function it calls and how to call it."""
    module: str
    function: str
    issue: int
    help: str
    needs_config: bool
    call: Callable[[Callable[..., Any], Any, argparse.Namespace], Any]


COMMANDS: dict[str, Command] = {
    "pretrain": Command("tupe_jax.train", "pretrain", 4, "pretrain a model (MLM or causal LM)", True,
                        lambda fn, cfg, a: fn(cfg, a.workdir)),
    "evaluate": Command("tupe_jax.train", "evaluate", 4, "evaluate a pretraining checkpoint", False,
                        lambda fn, cfg, a: fn(a.workdir, a.step)),
    "finetune": Command("tupe_jax.glue", "finetune", 5, "fine-tune a pretrained run on a GLUE task", True,
                        lambda fn, cfg, a: fn(cfg, a.workdir)),
    "glue-sweep": Command("tupe_jax.glue", "sweep", 5, "fine-tune over GLUE tasks and learning rates", True,
                          lambda fn, cfg, a: fn(cfg, a.workdir)),
    "extrapolate": Command("tupe_jax.analysis.extrapolate", "run", 6,
                           "perplexity / MLM loss vs evaluation length (several --workdir: one line each)", False,
                           lambda fn, cfg, a: fn(a.workdir, _lengths(a.lengths), mode=a.mode, stride=a.stride,
                                                 out=a.out, step=a.step)),
    "probe": Command("tupe_jax.analysis.probe", "run", 6, "probe each layer's hidden states for absolute position",
                     False, lambda fn, cfg, a: fn(a.workdir, out=a.out, step=a.step, steps=a.probe_steps)),
    "correlations": Command("tupe_jax.analysis.correlations", "run", 6,
                            "attention-logit decomposition (TUPE Fig. 2) and learned positional correlation (Fig. 6)",
                            False, lambda fn, cfg, a: fn(a.workdir, layer=a.layer, out=a.out, step=a.step)),
    "shuffle-attention": Command("tupe_jax.analysis.shuffle", "run", 6,
                                 "attention of a sentence vs its shuffle (causal vs bidirectional)", False,
                                 lambda fn, cfg, a: fn(a.workdir, text=a.text, layer=a.layer, out=a.out,
                                                       step=a.step)),
    "compare": Command("tupe_jax.compare", "run", 6, "run a suite over positional schemes and tabulate", True,
                       lambda fn, cfg, a: fn(cfg, a.workdir)),
    "demo": Command("tupe_jax.train", "demo", 4, "the end-to-end demo on the embedded corpus", False,
                    lambda fn, cfg, a: fn(a.workdir)),
}


# Extra flags of the analysis commands (issue #6); their --workdir may be repeated.
_OUT = (("--out",), dict(default=None, help="output directory (default: <first workdir>/analysis/)"))
_LAYER = (("--layer",), dict(type=int, default=0, help="layer to analyse (0 = first block)"))
ANALYSIS_FLAGS: dict[str, list] = {
    "extrapolate": [
        (("--lengths",), dict(default="128,256,512,1024", help="comma-separated evaluation lengths")),
        (("--mode",), dict(choices=("nonoverlapping", "sliding"), default="nonoverlapping",
                           help="evaluation windows (sliding: causal LMs only)")),
        (("--stride",), dict(type=int, default=None, help="sliding-window stride S (default: L; capped at L)")),
        _OUT],
    "probe": [(("--probe_steps",), dict(type=int, default=None, help="Adam steps per probe (default 300)")), _OUT],
    "correlations": [_LAYER, _OUT],
    "shuffle-attention": [(("--text",), dict(default=None, help="the sentence (default: a built-in one)")),
                          _LAYER, _OUT],
}


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line `error: ...` and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(message.replace("\n", " "), "", f"see `{self.prog} --help`")


def _lengths(raw: str) -> list[int]:
    try:
        lengths = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--lengths={raw!r} is not a comma-separated list of ints", "--lengths",
                        "write e.g. --lengths=128,256,512") from None
    if not lengths or min(lengths) <= 0:
        raise UserError(f"--lengths={raw!r} needs positive lengths", "--lengths", "write e.g. --lengths=128,256,512")
    return lengths


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser: one sub-command per entry of COMMANDS."""
    parser = _Parser(prog="python -m launch", description=__doc__.split("\n\n")[0],
                     epilog="Overrides: --config.section.key=value (type-checked against the config).")
    sub = parser.add_subparsers(dest="command", metavar="command", parser_class=_Parser)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        if name in ANALYSIS_FLAGS:
            p.add_argument("--workdir", required=True, action="append",
                           help="run directory; repeat to analyse several runs together")
        else:
            p.add_argument("--workdir", required=True, help="run directory (config.json, checkpoints, metrics)")
        if cmd.needs_config:
            p.add_argument("--config", required=True, help="configs/FILE.py[:arg]")
            p.add_argument("--overwrite_config", action="store_true",
                           help="replace a workdir/config.json that holds another run's config")
        p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
        for flags, kwargs in ANALYSIS_FLAGS.get(name, ()):
            p.add_argument(*flags, **kwargs)
        p.add_argument("--distributed", choices=("auto", "on", "off"), default="auto",
                       help="call jax.distributed.initialize() (auto: when several processes are configured)")
        p.add_argument("--coordinator_address", default=os.environ.get("JAX_COORDINATOR_ADDRESS"))
        p.add_argument("--num_processes", type=int, default=_env_int("JAX_NUM_PROCESSES"))
        p.add_argument("--process_id", type=int, default=_env_int("JAX_PROCESS_ID"))
    return parser


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    if not value.strip().lstrip("-").isdigit():
        raise UserError(f"environment variable {name}={value!r} is not an int", name, "unset it or give an int")
    return int(value)


def split_overrides(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Separate `--config.a.b=c` (or `--config.a.b c`) overrides from the other arguments."""
    rest: list[str] = []
    overrides: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config."):
            key, sep, value = arg[len("--config."):].partition("=")
            if not sep:
                if i + 1 >= len(argv):
                    raise UserError(f"--config.{key} has no value", f"--config.{key}", f"write --config.{key}=VALUE")
                i += 1
                value = argv[i]
            if not key:
                raise UserError("empty override key", arg, "write --config.section.key=VALUE")
            overrides[key] = value
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def resolve_function(name: str) -> Callable[..., Any]:
    """Import the library function behind command `name`, or raise UserError if it is not built yet."""
    cmd = COMMANDS[name]
    not_built = UserError(f"'{name}' is not built yet (issue #{cmd.issue})")
    try:
        module = importlib.import_module(cmd.module)
    except ModuleNotFoundError as err:
        parts = cmd.module.split(".")
        if err.name in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:
            raise not_built from None
        raise
    fn = getattr(module, cmd.function, None)
    if fn is None:
        raise not_built
    return fn


def maybe_initialize_distributed(args: argparse.Namespace) -> None:
    """Call `jax.distributed.initialize` when several processes are configured (must precede device use)."""
    hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    explicit = (args.num_processes or 1) > 1 or bool(args.coordinator_address)
    if args.distributed == "off" or (args.distributed == "auto" and not explicit and len(hosts) <= 1):
        return
    import jax  # pylint: disable=import-outside-toplevel
    if explicit:
        jax.distributed.initialize(coordinator_address=args.coordinator_address, num_processes=args.num_processes,
                                   process_id=args.process_id)
    else:
        jax.distributed.initialize()


def run(argv: Sequence[str]) -> int:
    """Parse, validate, dispatch. Raises UserError for anything the user can fix."""
    rest, overrides = split_overrides(argv)
    parser = build_parser()
    args = parser.parse_args(rest)
    if args.command is None:
        parser.print_help()
        return 2
    config = None
    if getattr(args, "config", None):
        from tupe_jax import config as config_lib  # pylint: disable=import-outside-toplevel
        config = config_lib.load_config(args.config)
        config_lib.apply_overrides(config, overrides)
    elif overrides:
        first = next(iter(overrides))
        raise UserError(f"--config.{first} given without --config", f"--config.{first}",
                        f"'{args.command}' reads the run's config from --workdir; drop the override")
    maybe_initialize_distributed(args)
    if config is not None:
        import jax  # pylint: disable=import-outside-toplevel
        from tupe_jax import config as config_lib  # pylint: disable=import-outside-toplevel
        config_lib.validate(config, jax.device_count())
    fn = resolve_function(args.command)
    before = _listing(args.workdir) if config is not None else None
    try:
        if config is not None:
            config_lib.write_workdir_config(args.workdir, config, overwrite=args.overwrite_config,
                                            write=jax.process_index() == 0)
        COMMANDS[args.command].call(fn, config, args)
    except UserError:
        if config is not None and jax.process_index() == 0:
            remove_partial_outputs(args.workdir, before)
        raise
    return 0


def _listing(workdir: str) -> set[str] | None:
    """The entries of `workdir` (None if it does not exist)."""
    return set(os.listdir(workdir)) if os.path.isdir(workdir) else None


def _holds_results(path: str) -> bool:
    """True if `path` holds a committed checkpoint step or a results file (worth keeping after an error)."""
    if os.path.isfile(path):
        return False
    for root, dirs, files in os.walk(path):
        if os.path.basename(root) == "checkpoints" and any(d.isdigit() for d in dirs):
            return True
        if {"results.json", "sweep.json"} & set(files):
            return True
    return False


def remove_partial_outputs(workdir: str, before: set[str] | None) -> None:
    """After a UserError: remove what this invocation created in `workdir` (config.json, tokenizer/, metrics, ...)
    unless it produced checkpoints or results. Entries that existed before are never touched."""
    import shutil  # pylint: disable=import-outside-toplevel
    if not os.path.isdir(workdir):
        return
    new = sorted(set(os.listdir(workdir)) - (before or set()))
    if any(_holds_results(os.path.join(workdir, name)) for name in new):
        return
    for name in new:
        path = os.path.join(workdir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except OSError:
                pass
    if before is None and not os.listdir(workdir):
        os.rmdir(workdir)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run and turn UserError into a one-line message and exit status 2."""
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except UserError as err:
        print(str(err), file=sys.stderr)
        return 2
