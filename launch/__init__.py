"""`python -m launch <command> --config=configs/X.py:arg --workdir=DIR [--config.a.b=c ...]`.

The command table (`COMMANDS`) and dispatch: parse flags, load + override the config, initialise multi-process
JAX if asked, run the command's own validator, claim the workdir (`workdir.claim`: config.json, cleanup after a
failure) and call the library function (imported lazily). Any `UserError` becomes one line `error: ...` on
stderr, exit 2; anything unexpected becomes one line pointing at a log file with the traceback, exit 1.

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
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

from tupe_jax import xla_options
from tupe_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Command:
    """A launcher command: the library function it calls, how to call it, and (for commands that take --config)
    the validator that checks the config before any compute (`module:function`), and what fills the keys the
    command line left to the config file's presets from elsewhere first (`adopt`: `module:function`, called with
    the config, the config-arg keys given and the override keys given; it returns the keys it set, printed)."""
    module: str
    function: str
    help: str
    call: Callable[[Callable[..., Any], Any, argparse.Namespace], Any]
    validator: str = ""          # "" = the command reads its config from --workdir
    adopt: str = ""

    @property
    def needs_config(self) -> bool:
        return bool(self.validator)


_PRETRAIN = "tupe_jax.pretrain.validate:validate"
_FINETUNE = "tupe_jax.finetune.validate:validate"
_ADOPT = "tupe_jax.finetune.init_from:adopt_model_keys"   # the model keys of config.init_from's run
COMMANDS: dict[str, Command] = {
    "pretrain": Command("tupe_jax.pretrain.loop", "pretrain", "pretrain a model (MLM or causal LM)",
                        lambda fn, cfg, a: fn(cfg, a.workdir), _PRETRAIN),
    "prepare": Command("tupe_jax.data.prepare", "prepare",
                       "tokenize a corpus once, in parallel, into sharded ArrayRecord + manifest (--workdir=DIR)",
                       lambda fn, cfg, a: fn(cfg, a.workdir), "tupe_jax.data.prepare:validate"),
    "evaluate": Command("tupe_jax.pretrain.evaluate", "evaluate", "evaluate a pretraining checkpoint",
                        lambda fn, cfg, a: fn(a.workdir, a.step)),
    "finetune": Command("tupe_jax.finetune.loop", "finetune", "fine-tune a pretrained run on a GLUE task",
                        lambda fn, cfg, a: fn(cfg, a.workdir), _FINETUNE, _ADOPT),
    "glue-sweep": Command("tupe_jax.finetune.sweep", "sweep", "fine-tune over GLUE tasks and learning rates",
                          lambda fn, cfg, a: fn(cfg, a.workdir), _FINETUNE, _ADOPT),
    "extrapolate": Command("tupe_jax.analysis.extrapolate", "run",
                           "perplexity / MLM loss vs evaluation length (several --workdir: one line each)",
                           lambda fn, cfg, a: fn(a.workdir, _lengths(a.lengths), mode=a.mode, stride=a.stride,
                                                 out=a.out, step=a.step)),
    "probe": Command("tupe_jax.analysis.probe", "run", "probe each layer's hidden states for absolute position",
                     lambda fn, cfg, a: fn(a.workdir, out=a.out, step=a.step, steps=a.probe_steps)),
    "correlations": Command("tupe_jax.analysis.correlations", "run",
                            "attention-logit decomposition (TUPE Fig. 2) and learned positional correlation (Fig. 6)",
                            lambda fn, cfg, a: fn(a.workdir, layer=a.layer, out=a.out, step=a.step)),
    "shuffle-attention": Command("tupe_jax.analysis.shuffle", "run",
                                 "attention of a sentence vs its shuffle (causal vs bidirectional)",
                                 lambda fn, cfg, a: fn(a.workdir, text=a.text, layer=a.layer, out=a.out,
                                                       step=a.step)),
    "compare": Command("tupe_jax.analysis.suite", "run", "run a suite over positional schemes and tabulate",
                       lambda fn, cfg, a: fn(cfg, a.workdir), "tupe_jax.analysis.suite:validate"),
    "demo": Command("launch.demo", "demo", "the end-to-end demo on the embedded corpus",
                    lambda fn, cfg, a: fn(a.workdir)),
    "import-hf": Command("launch.interop", "import_hf", "a Hugging Face BERT folder (safetensors) -> a bert_a run",
                         lambda fn, cfg, a: fn(a)),
    "import-fairseq": Command("launch.interop", "import_fairseq",
                              "the TUPE authors' fairseq checkpoint (.pt, dict.txt, BPE codes) -> a tupe_r/tupe_a run",
                              lambda fn, cfg, a: fn(a)),
    "export": Command("launch.interop", "export", "a run -> BertForMaskedLM layout (bert_a) or native safetensors",
                      lambda fn, cfg, a: fn(a)),
}


# Extra flags of the analysis commands; their --workdir may be repeated.
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
    "import-hf": [(("--from",), dict(dest="source", metavar="DIR", default=None,
                                     help="Hugging Face model folder (config.json, model.safetensors, vocab.txt)"))],
    "import-fairseq": [(("--from",), dict(dest="source", metavar="DIR", default=None,
                                          help="the extracted fairseq checkpoint folder (or its .pt)"))],
    "export": [(("--out",), dict(default=None, metavar="DIR", help="new folder for the exported model"))],
}


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line `error: ...` and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(message.replace("\n", " "), "", f"see `{self.prog} --help`")


# The commands that read one checkpoint step of a run (`--step`); the others refuse the flag with what to use.
STEP_COMMANDS = ("evaluate", "extrapolate", "probe", "correlations", "shuffle-attention", "export")
NO_STEP = {"finetune": "give the pretraining run's step as --config.init_step=N",
           "glue-sweep": "give the pretraining run's step as --config.init_step=N",
           "pretrain": "a run resumes from its newest checkpoint; for an earlier one, copy the run and delete the "
                       "newer steps"}


class _Once(argparse.Action):
    """A flag that may be given once: a second value would silently replace the first."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, f"_seen_{self.dest}", False):
            raise UserError(f"{option_string} is given twice", option_string, "give it once")
        setattr(namespace, f"_seen_{self.dest}", True)
        setattr(namespace, self.dest, values)


def _step(raw: str) -> int:
    if not raw.strip().isdecimal():   # argparse's error names the flag: "argument --step: ..."
        raise argparse.ArgumentTypeError(f"{raw!r} is not a checkpoint step (give a step >= 0, e.g. --step=1000)")
    return int(raw)


def _lengths(raw: str) -> list[int]:
    try:
        lengths = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--lengths={raw!r} is not a comma-separated list of ints", "--lengths",
                        "write e.g. --lengths=128,256,512") from None
    if not lengths or min(lengths) <= 0:
        raise UserError(f"--lengths={raw!r} needs positive lengths", "--lengths", "write e.g. --lengths=128,256,512")
    if min(lengths) < 2:     # one token has nothing to predict (refused here, not after the other lengths ran)
        raise UserError(f"evaluation length {min(lengths)} is too short", "--lengths", "use lengths of at least 2")
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
            p.add_argument("--workdir", required=True, action=_Once,
                           help="run directory (config.json, checkpoints, metrics)")
        if cmd.needs_config:
            p.add_argument("--config", required=True, help="configs/FILE.py[:arg]")
            p.add_argument("--overwrite_config", action="store_true",
                           help="replace a workdir/config.json that holds another run's config")
        p.add_argument("--step", type=_step, default=None, action=_Once, help="checkpoint step (default: latest)"
                       if name in STEP_COMMANDS else argparse.SUPPRESS)
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


def resolve(spec: str) -> Callable[..., Any]:
    """The function named "package.module:function"."""
    module, _, function = spec.partition(":")
    return getattr(importlib.import_module(module), function)


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
    command = COMMANDS[args.command]
    if args.step is not None and args.command not in STEP_COMMANDS:
        raise UserError(f"{args.command} takes no --step", "--step",
                        NO_STEP.get(args.command, "drop it (it is read by " + ", ".join(STEP_COMMANDS) + ")"))
    xla_options.opted_out()           # a bad TUPE_JAX_ONEDNN stops here, before any work
    config = None
    if command.needs_config:
        from tupe_jax import config as config_lib  # pylint: disable=import-outside-toplevel
        config = config_lib.load_config(args.config)
        config_lib.apply_overrides(config, overrides)
        if command.adopt:
            adopted = resolve(command.adopt)(config, config_lib.arg_keys(args.config), frozenset(overrides))
            if adopted:
                print(f"from {config.init_from}: " + ", ".join(adopted), flush=True)
    elif overrides:
        first = next(iter(overrides))
        raise UserError(f"--config.{first} given without --config", f"--config.{first}",
                        f"'{args.command}' reads the run's config from --workdir; drop the override")
    maybe_initialize_distributed(args)
    fn = resolve(f"{command.module}:{command.function}")
    if config is None:
        command.call(fn, config, args)
        return 0
    import jax  # pylint: disable=import-outside-toplevel
    from tupe_jax import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
    resolve(command.validator)(config, jax.device_count())
    with workdir_lib.claim(args.workdir, config, overwrite=args.overwrite_config):
        command.call(fn, config, args)
    return 0


def _first_workdir(argv: Sequence[str]) -> str:
    for i, arg in enumerate(argv):
        if arg.startswith("--workdir="):
            return arg.split("=", 1)[1]
        if arg == "--workdir" and i + 1 < len(argv):
            return argv[i + 1]
    return ""


def crash_log(workdir: str, text: str) -> str:
    """Write `text` (a traceback) to `<workdir>/logs/` when the workdir is a writable folder, else to the temp
    folder; return the path."""
    name = f"error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    folder = os.path.join(workdir, "logs") if workdir and os.path.isdir(workdir) and os.access(workdir, os.W_OK) \
        else tempfile.gettempdir()
    path = os.path.join(folder, name if folder != tempfile.gettempdir() else "tupe_jax-" + name)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError:
        return "(no log: the traceback could not be written)"
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: a UserError is one line and exit 2; anything unexpected is one line pointing at a log with the
    full traceback, exit 1 (the run's folder keeps what it had: see `workdir.claim`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return run(argv)
    except UserError as err:
        print(str(err), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted, --workdir, rerun the same command to continue from the last checkpoint",
              file=sys.stderr)
        return 130
    except Exception as err:  # pylint: disable=broad-except  # the last resort: never a bare traceback
        log = crash_log(_first_workdir(argv), traceback.format_exc())
        first = (str(err).strip().splitlines() or [""])[0][:200]
        print(f"error: unexpected {type(err).__name__}: {first}, {log}, the full traceback is in that file; "
              "rerun, or report it with the file", file=sys.stderr)
        return 1
