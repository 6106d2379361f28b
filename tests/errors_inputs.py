"""What the catalogue of bad inputs (tests/test_errors_catalogue.py) builds its command lines from: the tiny
pretrain/finetune commands (`pretrain()`, `finetune()`), the temporary tree they point into (`Env`) and the bad
inputs themselves (damaged copies of GLUE, of a run, of the data cache; fairseq checkpoints; a locked workdir).
Each builder makes its input once per module and returns its path.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from typing import Callable

import launch
from glue_fixtures import DIRS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = "--config=" + os.path.join(ROOT, "configs", "pretrain.py")
GLUE = "--config=" + os.path.join(ROOT, "configs", "glue.py")
TINY_MODEL = {"model.num_layers": 2, "model.hidden_size": 32, "model.num_heads": 2, "model.mlp_dim": 64,
              "model.vocab_size": 512, "model.max_len": 64}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    what: str                              # the bad input, in words (the docs table's first column)
    argv: Callable[["Env"], list[str]]     # the command line
    needle: str                            # what the message must name (key, file, line or flag)


@dataclasses.dataclass
class Env:
    """Paths the cases build their command lines from (one tmp tree per test module)."""
    tmp: str
    cache: str
    glue: str          # a valid GLUE directory (all nine tasks)
    run: str           # a tiny pretraining run (tupe_r, max_len 64): config.json, tokenizer/, checkpoints/10
    alibi: str = ""    # the same for alibi (a scheme that evaluates at any length)
    holders: list = dataclasses.field(default_factory=list)   # processes holding workdir locks (killed at the end)

    def wd(self, name: str) -> str:
        return os.path.join(self.tmp, "wd", name)

    def data(self, name: str) -> str:
        return os.path.join(self.tmp, "data", name)


def _ov(mapping: dict) -> list[str]:
    return [f"--config.{k}={v}" for k, v in mapping.items()]


def pretrain(env: Env, name: str, arg: str = "pe=tupe_r", **extra) -> list[str]:
    """A tiny pretraining command into a fresh workdir, plus `extra` overrides (dots as '__')."""
    overrides = {**TINY_MODEL, "model.max_len": 32, "train.steps": 2, "train.batch_size": 16,
                 "data.cache_dir": env.cache, "checkpoint.async_save": "false"}
    overrides.update({k.replace("__", "."): v for k, v in extra.items()})
    return ["pretrain", f"{PRETRAIN}:{arg}", f"--workdir={env.wd(name)}", *_ov(overrides)]


def finetune(env: Env, name: str, arg: str = "task=rte,pe=tupe_r", **extra) -> list[str]:
    """A tiny fine-tuning command from the pretraining run, plus `extra` overrides (dots as '__')."""
    overrides = {**TINY_MODEL, "init_from": env.run, "data.glue_dir": env.glue, "data.cache_dir": env.cache,
                 "train.batch_size": 8, "train.eval_batch_size": 8, "train.steps": 2}
    overrides.update({k.replace("__", "."): v for k, v in extra.items()})
    return ["finetune", f"{GLUE}:{arg}", f"--workdir={env.wd(name)}", *_ov(overrides)]


def glue_copy(env: Env, name: str, task: str, split: str, edit: Callable[[list[str]], list[str]]) -> str:
    """A copy of the GLUE dir with `edit` applied to the lines of <task>/<split>.tsv; returns the copy."""
    root = env.data(name)
    if not os.path.isdir(root):
        shutil.copytree(env.glue, root)
        path = os.path.join(root, DIRS[task], f"{split}.tsv")
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(edit(lines)) + "\n")
    return root


def glue_drop(env: Env, name: str, task: str, split: str) -> str:
    """A copy of the GLUE dir without <task>/<split>.tsv."""
    root = env.data(name)
    if not os.path.isdir(root):
        shutil.copytree(env.glue, root)
        os.remove(os.path.join(root, DIRS[task], f"{split}.tsv"))
    return root


def write(path: str, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


def dangling_link(env: Env) -> str:
    """A link to a folder that does not exist."""
    path = env.data("dangling")
    if not os.path.islink(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.symlink(env.data("nowhere"), path)
    return path


def other_run_workdir(env: Env) -> str:
    """A workdir whose config.json holds a pe=rope run (as `launch pretrain` would have written it)."""
    from tupe_jax import config as config_lib  # pylint: disable=import-outside-toplevel
    from tupe_jax import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
    wd = env.wd("other_run")
    if not os.path.isdir(wd):
        config = config_lib.load_config(f"{PRETRAIN[len('--config='):]}:pe=rope")
        config_lib.apply_overrides(config, {k: str(v) for k, v in TINY_MODEL.items()})
        workdir_lib.write_config(wd, config)
    return wd


def mismatched_tokenizer_workdir(env: Env) -> str:
    """A fine-tuning workdir that already holds a tokenizer other than the pretraining run's."""
    wd = env.wd("tokenizer_mismatch")
    with open(os.path.join(env.run, "tokenizer", "vocab.txt"), encoding="utf-8") as f:
        vocab = f.read().splitlines()
    vocab[10], vocab[11] = vocab[11], vocab[10]
    write(os.path.join(wd, "tokenizer", "vocab.txt"), ("\n".join(vocab) + "\n").encode())
    return wd


def text_corpus(env: Env, name: str) -> str:
    """A corpus folder under the env's data folder holding one train.txt."""
    return os.path.dirname(write(env.data(f"{name}/train.txt"), b"some text here\nand more text\n"))


def config_only_workdir(env: Env, name: str, text: str | None = None) -> str:
    """A workdir holding only the pretraining run's config.json (or `text` as config.json)."""
    wd = env.wd(name)
    os.makedirs(wd, exist_ok=True)
    if text is None:
        shutil.copy(os.path.join(env.run, "config.json"), os.path.join(wd, "config.json"))
    else:
        write(os.path.join(wd, "config.json"), text.encode())
    return wd


def base_run(env: Env) -> str:
    """A finished 2-step pretraining run made by `pretrain(env, 'base')` (the resume cases change one key)."""
    wd = env.wd("base")
    if not os.path.isdir(os.path.join(wd, "checkpoints")):
        assert launch.main(pretrain(env, "base")) == 0
    return wd


def copy_run(env: Env, name: str, edit: Callable[[dict], None] | None = None) -> str:
    """A copy of the pretraining run, with `edit` applied to its config.json."""
    wd = env.wd(name)
    if not os.path.isdir(wd):
        shutil.copytree(env.run, wd)
        if edit is not None:
            path = os.path.join(wd, "config.json")
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
            edit(config)
            write(path, json.dumps(config, indent=2).encode())
    return wd


def fairseq_ckpt(env: Env, name: str, **kw) -> str:
    """A tiny checkpoint folder in the TUPE code's fairseq format (tests/fairseq_fixtures.py), built once."""
    from tests import fairseq_fixtures as F  # pylint: disable=import-outside-toplevel
    root = env.data(name)
    if not os.path.isdir(root):
        F.write_checkpoint(root, F.HANDWRITTEN, **kw)
    return root


class OpensAFile:
    """Unpickling this would call open(): the safe load must refuse it unrun."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def import_fairseq(env: Env, source: str, name: str) -> list[str]:
    return ["import-fairseq", f"--from={source}", f"--workdir={env.wd(name)}"]


def learned_table() -> dict:
    import numpy as np  # pylint: disable=import-outside-toplevel
    return {"decoder.sentence_encoder.embed_positions.weight": np.zeros((66, 32), np.float32)}


def fairseq_no_dict(env: Env) -> str:
    root = fairseq_ckpt(env, "fairseq_no_dict")
    if os.path.isfile(os.path.join(root, "dict.txt")):
        os.remove(os.path.join(root, "dict.txt"))
    return root


def not_a_checkpoint(env: Env) -> str:
    root = env.data("fairseq_garbage")
    if not os.path.isdir(root):
        shutil.copytree(fairseq_ckpt(env, "fairseq_ok"), root)
        write(os.path.join(root, "checkpoint_best.pt"), b"not a pickle at all")
    return root


def finetune_run(env: Env) -> str:
    """A folder holding a fine-tuning config.json (as `launch finetune` writes it)."""
    from tupe_jax import config as config_lib  # pylint: disable=import-outside-toplevel
    config = config_lib.load_config(f"{GLUE[len('--config='):]}:task=rte")
    return config_only_workdir(env, "finetune_run", config_lib.to_json(config))


def glue_sweep_root(env: Env) -> str:
    """A `glue-sweep` folder over cola and rte: its config.json and one sub-run's below it."""
    from tupe_jax import config as config_lib  # pylint: disable=import-outside-toplevel
    config = config_lib.load_config(f"{GLUE[len('--config='):]}:task=rte")
    with config.unlocked():
        config.sweep.tasks = "cola,rte"
    path = config_only_workdir(env, "glue_sweep", config_lib.to_json(config))
    write(os.path.join(path, "rte", "lr=0.0001", "seed=0", "config.json"), config_lib.to_json(config).encode())
    return path


def finetune_run_with_checkpoints(env: Env) -> str:
    """A fine-tuning run's folder as init_from sees one: its config.json and a checkpoints/ folder."""
    from tupe_jax import config as config_lib  # pylint: disable=import-outside-toplevel
    config = config_lib.load_config(f"{GLUE[len('--config='):]}:task=rte")
    path = config_only_workdir(env, "finetune_run_ckpt", config_lib.to_json(config))
    os.makedirs(os.path.join(path, "checkpoints", "2"), exist_ok=True)
    return path


def locked(env: Env) -> str:
    """A workdir whose lock another live process holds."""
    wd = env.wd("locked")
    if not env.holders:
        code = "import sys, time\nfrom tupe_jax.workdir import RunLock\nwith RunLock(sys.argv[1]):\n" \
               "    print('locked', flush=True)\n    time.sleep(600)\n"
        holder = subprocess.Popen([sys.executable, "-c", code, wd], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "locked"
        env.holders.append(holder)
    return wd


def damaged_cache(env: Env) -> str:
    """A copy of the data cache whose token stream (.npy) is cut in half."""
    base_run(env)
    root = env.data("damaged_cache")
    if not os.path.isdir(root):
        shutil.copytree(env.cache, root)
        for folder, _, names in os.walk(os.path.join(root, "streams")):
            for name in names:
                if name.endswith(".tokens.npy"):
                    path = os.path.join(folder, name)
                    with open(path, "rb") as f:
                        data = f.read()
                    write(path, data[: len(data) // 2])
    return root


def damaged_run(env: Env) -> str:
    """A copy of the pretraining run whose only checkpoint (step 10) has garbage for its state's metadata (a file
    whose message is the same on every run: a damaged array file's names whichever array Orbax read first)."""
    root = env.data("damaged_run")
    if not os.path.isdir(root):
        shutil.copytree(env.run, root)
        write(os.path.join(root, "checkpoints", "10", "state", "_METADATA"), b"\x00{not json")
    return root


CONFIG_FILES = {   # --config files a user wrote, with their own mistakes
    "syntax": "def get_config(arg=None:\n    pass\n",
    "raises": "def get_config(arg=None):\n    raise RuntimeError('no such preset')\n",
    "dict": "def get_config(arg=None):\n    return {'train': {'steps': 3}}\n",
    "no_metrics": "from configs.pretrain import get_config as preset\n\n\ndef get_config(arg=None):\n"
                  "    config = preset(arg)\n    config.unlock()\n    del config['metrics']\n    return config\n",
    "misspelled": "from configs.pretrain import get_config as preset\n\n\ndef get_config(arg=None):\n"
                  "    config = preset(arg)\n    config.unlock()\n    config.train.stpes = 3\n    return config\n",
}


def config_file(env: Env, name: str) -> str:
    """`--config=` a user's config file (`CONFIG_FILES[name]`)."""
    return "--config=" + write(env.data(f"configs/{name}.py"), CONFIG_FILES[name].encode())


def suite_with_runs(env: Env) -> str:
    """A compare folder with its config.json (other eval.max_tokens than the default) and one sub-run's config.json
    (as a suite leaves it after its first pretraining run started)."""
    from tupe_jax import config as config_lib  # pylint: disable=import-outside-toplevel
    wd = env.wd("suite_with_runs")
    if not os.path.isdir(wd):
        config = config_lib.load_config(os.path.join(ROOT, "configs", "compare.py"))
        config_lib.apply_overrides(config, {"eval.max_tokens": "1000"})
        config_only_workdir(env, "suite_with_runs", config_lib.to_json(config))
        shutil.copy(os.path.join(env.run, "config.json"), write(os.path.join(wd, "bert_a-clm-s0", "config.json"), b""))
    return wd
