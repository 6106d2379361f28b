"""The launcher's flags beside `--workdir`/`--config`: each command's own flags (`ANALYSIS_FLAGS`), which commands
take `--step`, `--config.a.b=c` overrides split from the rest, and the `--config.data.*` overrides of the commands
that score a run (`evaluate`, `extrapolate`, `probe`, `correlations`) on another corpus than its own."""
from __future__ import annotations

import argparse
from typing import Sequence

from tupe_jax.errors import UserError


class Once(argparse.Action):
    """A flag that may be given once: a second value would silently replace the first."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, f"_seen_{self.dest}", False):
            raise UserError(f"{option_string} is given twice", option_string, "give it once")
        setattr(namespace, f"_seen_{self.dest}", True)
        setattr(namespace, self.dest, values)


# Extra flags of the analysis commands; their --workdir may be repeated.
_OUT = (("--out",), dict(default=None, action=Once, help="output directory (default: <first workdir>/analysis/)"))
_LAYER = (("--layer",), dict(type=int, default=0, action=Once, help="layer to analyse (0 = first block)"))
ANALYSIS_FLAGS: dict[str, list] = {
    "extrapolate": [
        (("--lengths",), dict(action=Once, default="128,256,512,1024",
                              help="comma-separated evaluation lengths")),
        (("--mode",), dict(action=Once, choices=("nonoverlapping", "sliding"), default="nonoverlapping",
                           help="evaluation windows (sliding: causal LMs only)")),
        (("--stride",), dict(type=int, action=Once, default=None,
                             help="sliding-window stride S (default: L; capped at L)")),
        _OUT],
    "probe": [(("--probe_steps",), dict(type=int, action=Once, default=None,
                                        help="Adam steps per probe (default 300: quick, not converged; the "
                                             "compare suite's 30000 on 524288 tokens are near it on its tiny runs: "
                                             "docs/experiments/probe-sweep)")),
              (("--probe_tokens",), dict(type=int, action=Once, default=None,
                                         help="training tokens of the probes (default 16384), whole windows of "
                                              "the train split (rounded up); about three copies of every layer's "
                                              "features of them are held at the peak, each tokens x (layers+1) "
                                              "x d x 4 bytes")),
              _OUT],
    "correlations": [_LAYER, _OUT],
    "shuffle-attention": [(("--text",), dict(action=Once, default=None,
                                             help="the sentence (default: a built-in one)")),
                          _LAYER, _OUT],
    "import-hf": [(("--from",), dict(dest="source", action=Once, metavar="DIR", default=None,
                                     help="Hugging Face model folder (config.json, model.safetensors, vocab.txt)"))],
    "import-fairseq": [(("--from",), dict(dest="source", action=Once, metavar="DIR", default=None,
                                          help="the extracted fairseq checkpoint folder (or its .pt)"))],
    "export": [(("--out",), dict(default=None, action=Once, metavar="DIR",
                                 help="new folder for the exported model"))],
}


# What a command without --config takes its settings from, where it is not the run in --workdir.
NO_CONFIG = {"demo": "'demo' runs its own fixed config (launch/demo.py); for other settings use pretrain",
             "import-hf": "'import-hf' takes the model's settings from --from",
             "import-fairseq": "'import-fairseq' takes the model's settings from --from"}

# The commands that read one checkpoint step of a run (`--step`); the others refuse the flag with what to use.
STEP_COMMANDS = ("evaluate", "extrapolate", "probe", "correlations", "shuffle-attention", "export")
NO_STEP = {"finetune": "give the pretraining run's step as --config.init_step=N",
           "glue-sweep": "give the pretraining run's step as --config.init_step=N",
           "pretrain": "a run resumes from its newest checkpoint; for an earlier one, copy the run and delete the "
                       "newer steps"}


def step(raw: str) -> int:
    """`--step`: a checkpoint step >= 0."""
    if not raw.strip().isdecimal():   # argparse's error names the flag: "argument --step: ..."
        raise argparse.ArgumentTypeError(f"{raw!r} is not a checkpoint step (give a step >= 0, e.g. --step=1000)")
    return int(raw)


def lengths(raw: str) -> list[int]:
    """`--lengths`: comma-separated evaluation lengths, each at least 2."""
    try:
        values = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--lengths={raw!r} is not a comma-separated list of ints", "--lengths",
                        "write e.g. --lengths=128,256,512") from None
    if not values or min(values) <= 0:
        raise UserError(f"--lengths={raw!r} needs positive lengths", "--lengths", "write e.g. --lengths=128,256,512")
    if min(values) < 2:     # one token has nothing to predict (refused here, not after the other lengths ran)
        raise UserError(f"evaluation length {min(values)} is too short", "--lengths", "use lengths of at least 2")
    return values


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
            if key in overrides:   # the last would silently win
                raise UserError(f"--config.{key} is given twice", f"--config.{key}", "give it once")
            overrides[key] = value
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


# The commands that score a run on text: `--config.data.KEY=VALUE` names another corpus for them (the run's own
# tokenizer reads it). Each takes the corpus keys and the data keys it reads besides; any other key is refused.
CORPUS_KEYS = ("name", "path", "file_pattern", "split_by", "holdout", "cache_dir", "tfds_data_dir", "tfds_text_key")
CORPUS_COMMANDS = {"evaluate": CORPUS_KEYS + ("mask_prob", "max_predictions", "packing", "prefetch", "num_threads"),
                   "extrapolate": CORPUS_KEYS + ("mask_prob",), "probe": CORPUS_KEYS, "correlations": CORPUS_KEYS}


def corpus_overrides(command: str, overrides: dict[str, str]) -> dict[str, str]:
    """The overrides of a command without `--config`: `--config.data.*` keys the command reads, for one of
    `CORPUS_COMMANDS`; anything else is refused, naming the first such key."""
    reads = CORPUS_COMMANDS.get(command, ())
    for key in overrides:
        where = f"--config.{key}"
        section, _, leaf = key.partition(".")
        if not reads or section != "data":
            raise UserError(f"{where} given without --config", where,
                            NO_CONFIG.get(command, f"'{command}' reads the run's config from --workdir") +
                            ("; it takes --config.data.* only (another corpus to score)" if reads else "") +
                            "; drop the override")
        if leaf == "vocab_file":
            raise UserError(f"'{command}' reads text with the run's own tokenizer (its tokenizer/vocab.txt)", where,
                            "drop the override; a run with another vocabulary is another model")
        if leaf not in reads:
            raise UserError(f"'{command}' does not read data.{leaf}", where,
                            "drop the override (it takes --config.data." + ", ".join(reads) + ")")
    return dict(overrides)
