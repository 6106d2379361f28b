"""`python -m launch <command> --config=configs/X.py:arg --workdir=DIR [--config.a.b=c ...]`.

The command table (`COMMANDS`) and dispatch: parse flags, load + override the config, initialise multi-process
JAX if asked, run the command's own validator, claim the workdir (`workdir.claim`: config.json, cleanup after a
failure) and call the library function (imported lazily). Any `UserError` becomes one line `error: ...` on
stderr, exit 2; anything unexpected becomes one line pointing at a log file with the traceback, exit 1.

Each command's own flags and the overrides a command without --config takes: `launch/flags.py`. Multi-process
flags: `launch/cluster.py`.
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

from launch import cluster, flags
from launch.flags import ANALYSIS_FLAGS, NO_STEP, STEP_COMMANDS, Once, split_overrides
from tupe_jax import xla_options
from tupe_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Command:
    """A launcher command: the library function it calls, how to call it, and (for commands that take --config)
    the validator that checks the config before any compute (`module:function`), and what fills the keys the
    command line left to the config file's presets from elsewhere first, or refuses overrides the command would
    replace or not read (`adopt`: `module:function`, called with the config, the config-arg keys given, the
    override keys given and `workdir=`; it returns the keys it set, printed)."""
    module: str
    function: str
    help: str
    call: Callable[[Callable[..., Any], Any, argparse.Namespace], Any]
    validator: str = ""          # "" = the command reads its config from --workdir
    adopt: str = ""
    config_file: str = ""        # configs/<name>.py: the keys this command reads (a --config file must have them)

    @property
    def needs_config(self) -> bool:
        return bool(self.validator)

    def reference(self) -> tuple[Any, str]:
        """(the config with the keys this command reads, its file): a --config file must have the same keys."""
        return resolve(f"configs.{self.config_file}:get_config")(None), f"configs/{self.config_file}.py"


_PRETRAIN = "tupe_jax.pretrain.validate:validate"
_FINETUNE = "tupe_jax.finetune.validate:validate"
_ADOPT = "tupe_jax.finetune.init_from:adopt_model_keys"   # the model keys of config.init_from's run
COMMANDS: dict[str, Command] = {
    "pretrain": Command("tupe_jax.pretrain.loop", "pretrain", "pretrain a model (MLM or causal LM)",
                        lambda fn, cfg, a: fn(cfg, a.workdir), _PRETRAIN,
                        "tupe_jax.pretrain.validate:adopt", config_file="pretrain"),
    "prepare": Command("tupe_jax.data.prepare", "prepare",
                       "tokenize a corpus once, in parallel, into sharded ArrayRecord + manifest (--workdir=DIR)",
                       lambda fn, cfg, a: fn(cfg, a.workdir), "tupe_jax.data.prepare:validate",
                       "tupe_jax.data.prepare:refuse_unread_keys", config_file="prepare"),
    "evaluate": Command("tupe_jax.pretrain.evaluate", "evaluate", "evaluate a pretraining checkpoint",
                        lambda fn, cfg, a: fn(a.workdir, a.step, data=a.data)),
    "finetune": Command("tupe_jax.finetune.loop", "finetune", "fine-tune a pretrained run on a GLUE task",
                        lambda fn, cfg, a: fn(cfg, a.workdir), _FINETUNE, _ADOPT, "glue"),
    "glue-sweep": Command("tupe_jax.finetune.sweep", "sweep", "fine-tune over GLUE tasks and learning rates",
                          lambda fn, cfg, a: fn(cfg, a.workdir), _FINETUNE, _ADOPT, "glue"),
    "extrapolate": Command("tupe_jax.analysis.extrapolate", "run",
                           "perplexity / MLM loss vs evaluation length (several --workdir: one line each)",
                           lambda fn, cfg, a: fn(a.workdir, flags.lengths(a.lengths), mode=a.mode, stride=a.stride,
                                                 out=a.out, step=a.step, data=a.data)),
    "probe": Command("tupe_jax.analysis.probe", "run", "probe each layer's hidden states for absolute position",
                     lambda fn, cfg, a: fn(a.workdir, out=a.out, step=a.step, steps=a.probe_steps,
                                             train_tokens=a.probe_tokens, data=a.data)),
    "correlations": Command("tupe_jax.analysis.correlations", "run",
                            "attention-logit decomposition (TUPE Fig. 2) and learned positional correlation (Fig. 6)",
                            lambda fn, cfg, a: fn(a.workdir, layer=a.layer, out=a.out, step=a.step, data=a.data)),
    "shuffle-attention": Command("tupe_jax.analysis.shuffle", "run",
                                 "attention of a sentence vs its shuffle (causal vs bidirectional)",
                                 lambda fn, cfg, a: fn(a.workdir, text=a.text, layer=a.layer, out=a.out,
                                                       step=a.step)),
    "compare": Command("tupe_jax.analysis.suite", "run", "run a suite over positional schemes and tabulate",
                       lambda fn, cfg, a: fn(cfg, a.workdir), "tupe_jax.analysis.suite:validate",
                       "tupe_jax.analysis.suite_glue:refuse_set_keys", "compare"),
    "report": Command("tupe_jax.analysis.report", "render",
                      "re-render a compare suite's REPORT.md and plots from its report.json (findings recomputed)",
                      lambda fn, cfg, a: print("report: wrote " + ", ".join(fn(a.workdir)) + f" in {a.workdir}")),
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


TRAINS = ("pretrain", "finetune", "glue-sweep", "compare", "demo")   # their loops stop on SIGTERM (checkpoint.py)


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line `error: ...` and exit 2, and a flag must be spelled out (`--work`
    is not taken for `--workdir`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(message.replace("\n", " "), "", f"see `{self.prog} --help`")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """A flag the command does not know is named before a missing required one (`demo --bogus` said that
        --workdir is required, and only that)."""
        try:
            return super().parse_known_args(args, namespace)
        except UserError as err:
            if "arguments are required" not in err.what or getattr(err, "flags_checked", False):
                raise                  # checked by the command's own parser, which raised it
            err.flags_checked = True   # type: ignore[attr-defined]
            known = {o for a in self._actions for o in a.option_strings}
            unknown = [a for a in args or () if a.startswith("--") and a.split("=", 1)[0] not in known]
            if unknown:
                self.error(f"unrecognized arguments: {' '.join(unknown)}")
            raise


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
            p.add_argument("--workdir", required=True, action=Once,
                           help="run directory (config.json, checkpoints, metrics)")
        if cmd.needs_config:
            p.add_argument("--config", required=True, action=Once, help="configs/FILE.py[:arg]")
            p.add_argument("--overwrite_config", action="store_true",
                           help="replace a workdir/config.json that holds another run's config")
        p.add_argument("--step", type=flags.step, default=None, action=Once, help="checkpoint step (default: latest)"
                       if name in STEP_COMMANDS else argparse.SUPPRESS)
        for names, kwargs in ANALYSIS_FLAGS.get(name, ()):
            p.add_argument(*names, **kwargs)
        p.add_argument("--distributed", choices=("auto", "on", "off"), default="auto", action=Once,
                       help="call jax.distributed.initialize() (auto: when several processes are configured, "
                       "or on a Cloud TPU VM)")
        p.add_argument("--coordinator_address", default=os.environ.get("JAX_COORDINATOR_ADDRESS"), action=Once)
        p.add_argument("--num_processes", type=int, default=cluster.env_int("JAX_NUM_PROCESSES"), action=Once)
        p.add_argument("--process_id", type=int, default=cluster.env_int("JAX_PROCESS_ID"), action=Once)
    return parser


def resolve(spec: str) -> Callable[..., Any]:
    """The function named "package.module:function"."""
    module, _, function = spec.partition(":")
    return getattr(importlib.import_module(module), function)


def _expand_home(args: argparse.Namespace) -> None:
    """`~` in a path flag means the home folder for every flag alike (a shell leaves `--workdir=~/x` as it is)."""
    for name in ("workdir", "out", "source"):
        value = getattr(args, name, None)
        if isinstance(value, list):
            setattr(args, name, [os.path.expanduser(v) for v in value])
        elif isinstance(value, str):
            setattr(args, name, os.path.expanduser(value))


def run(argv: Sequence[str]) -> int:
    """Parse, validate, dispatch. Raises UserError for anything the user can fix."""
    rest, overrides = split_overrides(argv)
    parser = build_parser()
    args = parser.parse_args(rest)
    if args.command is None:
        parser.print_help()
        return 2
    command = COMMANDS[args.command]
    _expand_home(args)
    cluster.check_processes(args)
    if args.step is not None and args.command not in STEP_COMMANDS:
        raise UserError(f"{args.command} takes no --step", "--step",
                        NO_STEP.get(args.command, "drop it (it is read by " + ", ".join(STEP_COMMANDS) + ")"))
    if getattr(args, "out", None):
        from tupe_jax.workdir.gate import refuse_inside_suite  # pylint: disable=import-outside-toplevel
        refuse_inside_suite(args.out, "--out")
    xla_options.setting()             # a bad TUPE_JAX_ONEDNN stops here, before any work
    config = None
    if command.needs_config:
        from tupe_jax import config as config_lib  # pylint: disable=import-outside-toplevel
        config = config_lib.load_config(args.config, command.reference())
        config_lib.apply_overrides(config, overrides)
    else:    # --config.data.*: another corpus for the commands that score a run; other overrides are refused
        args.data = flags.corpus_overrides(args.command, overrides)
    cluster.maybe_initialize_distributed(args)
    if args.command in TRAINS:   # from here: a SIGTERM during the setup (minutes on a big corpus) is seen by the
        from tupe_jax import checkpoint as ckpt_lib  # pylint: disable=import-outside-toplevel  # loop, which stops
        ckpt_lib.install_sigterm_handler()           # before its first step; the folder's lock is released as usual
    fn = resolve(f"{command.module}:{command.function}")
    if config is None:
        cluster.agree_on_command(args)
        command.call(fn, config, args)
        return 0
    import jax  # pylint: disable=import-outside-toplevel
    from tupe_jax import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
    cluster.refuse_undistributed_processes()

    def checks() -> None:    # in the claim's agreement: a failure on one process stops every process
        if command.adopt:
            adopted = resolve(command.adopt)(config, config_lib.arg_keys(args.config), frozenset(overrides),
                                             workdir=args.workdir)
            if adopted:
                print(f"from {config.init_from}: " + ", ".join(adopted), flush=True)
        resolve(command.validator)(config, jax.device_count())
    with workdir_lib.claim(args.workdir, config, overwrite=args.overwrite_config, kind=args.command, validate=checks):
        command.call(fn, config, args)
    return 0


def _first_workdir(argv: Sequence[str]) -> str:
    """The folder a crash log goes to: the first --workdir, but not a run the command only reads (`export`'s source,
    a run scored on another corpus)."""
    if argv and (argv[0] == "export" or argv[0] in cluster.READS_RUNS and any(a.startswith("--config.data.")
                                                                                for a in argv)):
        return ""
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


class _ClosedStdoutIsQuiet:
    """sys.stdout for the command line: when its reader goes away (`... | head`, a closed pager), further output is
    dropped with one note on stderr, and the command goes on. A BrokenPipeError from a progress line ended a training
    run as an unexpected error, and removed the folder of a run without a checkpoint yet."""

    def __init__(self, stream: Any) -> None:
        self._stream, self._closed = stream, False

    def _gone(self) -> None:
        self._closed = True
        try:      # the interpreter's last flush then writes to /dev/null instead of failing again
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
        except (OSError, ValueError):
            pass
        print("note: standard output was closed (its reader ended); the command goes on without printing, and "
              "what it writes goes to its folder as usual", file=sys.stderr, flush=True)

    def write(self, text: str) -> int:
        if not self._closed:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self._closed:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._gone()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def quiet_when_stdout_closes() -> None:
    """Install `_ClosedStdoutIsQuiet` as sys.stdout (`python -m launch` does, before `main`)."""
    if not isinstance(sys.stdout, _ClosedStdoutIsQuiet):
        sys.stdout = _ClosedStdoutIsQuiet(sys.stdout)


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
        print("error: interrupted, --workdir, rerun the same command to continue (a training run from its last "
              "checkpoint)", file=sys.stderr)
        return 130
    except Exception as err:  # pylint: disable=broad-except  # the last resort: never a bare traceback
        log = crash_log(_first_workdir(argv), traceback.format_exc())
        first = (str(err).strip().splitlines() or [""])[0][:200]
        print(f"error: unexpected {type(err).__name__}: {first}, {log}, the full traceback is in that file; "
              "rerun, or report it with the file", file=sys.stderr)
        return 1
