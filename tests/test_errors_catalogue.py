"""The catalogue of bad inputs (issue #8): each gives ONE line `error: ...` naming the key, file or line, exit 2, no
traceback, and leaves no partial outputs behind.

Cases run in-process through `launch.main(argv)` (what `python -m launch` calls); a few also run as real
subprocesses to prove the end-to-end behaviour. `python tools/gen_errors_doc.py` reruns this file with
TUPE_JAX_ERRORS_DOC set and writes docs/errors.md (the table of cases and messages) from the CASES below.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Callable

import pytest

import launch
from glue_fixtures import DIRS, make_pretrained, write_glue_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = "--config=" + os.path.join(ROOT, "configs", "pretrain.py")
GLUE = "--config=" + os.path.join(ROOT, "configs", "glue.py")
TINY_MODEL = {"model.num_layers": 2, "model.hidden_size": 32, "model.num_heads": 2, "model.mlp_dim": 64,
              "model.vocab_size": 512, "model.max_len": 64}


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


def _glue_copy(env: Env, name: str, task: str, split: str, edit: Callable[[list[str]], list[str]]) -> str:
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


def _glue_drop(env: Env, name: str, task: str, split: str) -> str:
    """A copy of the GLUE dir without <task>/<split>.tsv."""
    root = env.data(name)
    if not os.path.isdir(root):
        shutil.copytree(env.glue, root)
        os.remove(os.path.join(root, DIRS[task], f"{split}.tsv"))
    return root


def _write(path: str, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


def _other_run_workdir(env: Env) -> str:
    """A workdir whose config.json holds a pe=rope run (as `launch pretrain` would have written it)."""
    from tupe_jax import config as config_lib  # pylint: disable=import-outside-toplevel
    from tupe_jax import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
    wd = env.wd("other_run")
    if not os.path.isdir(wd):
        config = config_lib.load_config(f"{PRETRAIN[len('--config='):]}:pe=rope")
        config_lib.apply_overrides(config, {k: str(v) for k, v in TINY_MODEL.items()})
        workdir_lib.write_config(wd, config)
    return wd


def _mismatched_tokenizer_workdir(env: Env) -> str:
    """A fine-tuning workdir that already holds a tokenizer other than the pretraining run's."""
    wd = env.wd("tokenizer_mismatch")
    with open(os.path.join(env.run, "tokenizer", "vocab.txt"), encoding="utf-8") as f:
        vocab = f.read().splitlines()
    vocab[10], vocab[11] = vocab[11], vocab[10]
    _write(os.path.join(wd, "tokenizer", "vocab.txt"), ("\n".join(vocab) + "\n").encode())
    return wd


def _config_only_workdir(env: Env, name: str, text: str | None = None) -> str:
    """A workdir holding only the pretraining run's config.json (or `text` as config.json)."""
    wd = env.wd(name)
    os.makedirs(wd, exist_ok=True)
    if text is None:
        shutil.copy(os.path.join(env.run, "config.json"), os.path.join(wd, "config.json"))
    else:
        _write(os.path.join(wd, "config.json"), text.encode())
    return wd


def _base(env: Env) -> str:
    """A finished 2-step pretraining run made by `pretrain(env, 'base')` (the resume cases change one key)."""
    wd = env.wd("base")
    if not os.path.isdir(os.path.join(wd, "checkpoints")):
        assert launch.main(pretrain(env, "base")) == 0
    return wd


def _copy_run(env: Env, name: str, edit: Callable[[dict], None] | None = None) -> str:
    """A copy of the pretraining run, with `edit` applied to its config.json."""
    wd = env.wd(name)
    if not os.path.isdir(wd):
        shutil.copytree(env.run, wd)
        if edit is not None:
            path = os.path.join(wd, "config.json")
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
            edit(config)
            _write(path, json.dumps(config, indent=2).encode())
    return wd


def _fairseq_ckpt(env: Env, name: str, **kw) -> str:
    """A tiny checkpoint folder in the TUPE code's fairseq format (tests/fairseq_fixtures.py), built once."""
    from tests import fairseq_fixtures as F  # pylint: disable=import-outside-toplevel
    root = env.data(name)
    if not os.path.isdir(root):
        F.write_checkpoint(root, F.HANDWRITTEN, **kw)
    return root


class _OpensAFile:
    """Unpickling this would call open(): the safe load must refuse it unrun."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _import_fairseq(env: Env, source: str, name: str) -> list[str]:
    return ["import-fairseq", f"--from={source}", f"--workdir={env.wd(name)}"]


def _learned_table() -> dict:
    import numpy as np  # pylint: disable=import-outside-toplevel
    return {"decoder.sentence_encoder.embed_positions.weight": np.zeros((66, 32), np.float32)}


def _fairseq_no_dict(env: Env) -> str:
    root = _fairseq_ckpt(env, "fairseq_no_dict")
    if os.path.isfile(os.path.join(root, "dict.txt")):
        os.remove(os.path.join(root, "dict.txt"))
    return root


def _not_a_checkpoint(env: Env) -> str:
    root = env.data("fairseq_garbage")
    if not os.path.isdir(root):
        shutil.copytree(_fairseq_ckpt(env, "fairseq_ok"), root)
        _write(os.path.join(root, "checkpoint_best.pt"), b"not a pickle at all")
    return root


def _finetune_run(env: Env) -> str:
    """A folder holding a fine-tuning config.json (as `launch finetune` writes it)."""
    from tupe_jax import config as config_lib  # pylint: disable=import-outside-toplevel
    config = config_lib.load_config(f"{GLUE[len('--config='):]}:task=rte")
    return _config_only_workdir(env, "finetune_run", config_lib.to_json(config))


def _locked(env: Env) -> str:
    """A workdir whose lock another live process holds."""
    wd = env.wd("locked")
    if not env.holders:
        code = "import sys, time\nfrom tupe_jax.workdir import RunLock\nwith RunLock(sys.argv[1]):\n" \
               "    print('locked', flush=True)\n    time.sleep(600)\n"
        holder = subprocess.Popen([sys.executable, "-c", code, wd], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "locked"
        env.holders.append(holder)
    return wd


def _damaged_cache(env: Env) -> str:
    """A copy of the data cache whose token stream (.npy) is cut in half."""
    _base(env)
    root = env.data("damaged_cache")
    if not os.path.isdir(root):
        shutil.copytree(env.cache, root)
        for folder, _, names in os.walk(os.path.join(root, "streams")):
            for name in names:
                if name.endswith(".tokens.npy"):
                    path = os.path.join(folder, name)
                    with open(path, "rb") as f:
                        data = f.read()
                    _write(path, data[: len(data) // 2])
    return root


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    what: str                              # the bad input, in words (the docs table's first column)
    argv: Callable[[Env], list[str]]       # the command line
    needle: str                            # what the message must name (key, file, line or flag)


CASES = [
    # ---------------------------------------------------------------- config keys and values
    Case("unknown_key", "unknown config key", lambda e: pretrain(e, "k1", train__nope=1), "train.nope"),
    Case("mistyped_key", "mistyped config key (hiden_size)", lambda e: pretrain(e, "k2", model__hiden_size=64),
         "model.hiden_size"),
    Case("mistyped_section", "mistyped config section (modle.pe)", lambda e: pretrain(e, "k3", modle__pe="rope"),
         "modle.pe"),
    Case("wrong_type", "value of the wrong type", lambda e: pretrain(e, "k4", train__steps="ten"),
         "--config.train.steps"),
    Case("bad_bool", "not a bool", lambda e: pretrain(e, "k5", checkpoint__async_save="maybe"),
         "--config.checkpoint.async_save"),
    Case("section_as_value", "a section set as a value", lambda e: pretrain(e, "k6", model="big"), "model"),
    Case("unknown_scheme", "unknown positional scheme (config arg)", lambda e: pretrain(e, "s1", "pe=fourier"),
         "pe="),
    Case("unknown_scheme_override", "unknown positional scheme (override)",
         lambda e: pretrain(e, "s2", model__pe="fourier"), "model.pe"),
    Case("unknown_config_arg", "unknown size preset", lambda e: pretrain(e, "s3", "pe=rope,size=huge"), "size"),
    Case("missing_config_file", "config file that does not exist",
         lambda e: ["pretrain", "--config=configs/nope.py", f"--workdir={e.wd('s4')}"], "--config"),
    Case("impossible_mesh", "mesh that does not fit the 8 devices", lambda e: pretrain(e, "m1", mesh__data=3),
         "--config.mesh.data"),
    Case("two_fill_axes", "two mesh axes set to -1", lambda e: pretrain(e, "m2", mesh__fsdp=-1), "--config.mesh"),
    Case("batch_not_divisible", "batch not divisible by the data-parallel size",
         lambda e: pretrain(e, "m3", train__batch_size=12), "--config.train.batch_size"),
    Case("negative_size", "negative model size", lambda e: pretrain(e, "n1", model__hidden_size=-32),
         "--config.model.hidden_size"),
    Case("negative_steps", "negative step count", lambda e: pretrain(e, "n2", train__steps=-5),
         "--config.train.steps"),
    Case("zero_layers", "zero layers", lambda e: pretrain(e, "n3", model__num_layers=0), "--config.model.num_layers"),
    Case("heads_not_dividing", "head count that does not divide hidden_size",
         lambda e: pretrain(e, "n4", model__num_heads=3), "--config.model.num_heads"),
    Case("unknown_dropout_rng", "unknown dropout PRNG implementation",
         lambda e: pretrain(e, "n6", train__dropout_rng="philox"), "--config.train.dropout_rng"),
    Case("mask_prob", "MLM mask_prob outside (0, 1)", lambda e: pretrain(e, "n5", data__mask_prob=1.5),
         "--config.data.mask_prob"),
    # ---------------------------------------------------------------- data
    Case("missing_data_path", "missing data path",
         lambda e: pretrain(e, "d1", data__name="text_files", data__path=e.data("nope")), "data.path"),
    Case("empty_corpus", "empty corpus",
         lambda e: pretrain(e, "d2", data__name="text_files",
                            data__path=os.path.dirname(_write(e.data("empty/train.txt"), b"\n\n"))), "empty"),
    Case("non_utf8", "non-UTF-8 text (names file:line)",
         lambda e: pretrain(e, "d3", data__name="text_files",
                            data__path=_write(e.data("latin1.txt"), b"first line\ncaf\xe9 au lait\n")),
         "latin1.txt:2"),
    Case("unknown_data_name", "unknown dataset name", lambda e: pretrain(e, "d4", data__name="books"), "data.name"),
    Case("missing_vocab_file", "vocab file that does not exist",
         lambda e: pretrain(e, "d5", data__vocab_file=e.data("nope/vocab.txt")), "data.vocab_file"),
    Case("vocab_larger_than_model", "vocab file larger than model.vocab_size",
         lambda e: pretrain(e, "d6", data__vocab_file=os.path.join(e.run, "tokenizer", "vocab.txt"),
                            model__vocab_size=256), "vocab.txt"),
    # ---------------------------------------------------------------- GLUE
    Case("glue_wrong_columns", "GLUE TSV row with the wrong number of columns (names file:line)",
         lambda e: finetune(e, "g1", data__glue_dir=_glue_copy(e, "glue_cols", "rte", "train",
                                                               lambda ls: ls[:3] + ["7\tonly two"] + ls[3:])),
         "RTE/train.tsv:4"),
    Case("glue_bad_label", "GLUE TSV with a bad label (names file:line)",
         lambda e: finetune(e, "g2", data__glue_dir=_glue_copy(e, "glue_label", "rte", "dev",
                                                               lambda ls: ls[:2] + [ls[2].rsplit("\t", 1)[0]
                                                                                    + "\tmaybe"] + ls[3:])),
         "RTE/dev.tsv:3"),
    Case("glue_missing_header_column", "GLUE TSV whose header lacks a column",
         lambda e: finetune(e, "g3", data__glue_dir=_glue_copy(e, "glue_head", "rte", "train",
                                                               lambda ls: ["index\tsentence1\ttext\tlabel"] + ls[1:])),
         "RTE/train.tsv:1"),
    Case("glue_missing_dir", "GLUE directory that does not exist",
         lambda e: finetune(e, "g4", data__glue_dir=e.data("no_glue")), "no_glue"),
    Case("unknown_task", "unknown GLUE task", lambda e: finetune(e, "g5", "task=squad,pe=tupe_r"), "task"),
    Case("unknown_task_override", "unknown GLUE task (override)", lambda e: finetune(e, "g6", task="squad"),
         "--config.task"),
    # ---------------------------------------------------------------- init_from / checkpoints / workdirs
    Case("init_from_nothing", "init_from pointing at nothing",
         lambda e: finetune(e, "i1", init_from=e.data("no_run")), "--config.init_from"),
    Case("init_from_other_scheme", "init_from a run of another scheme",
         lambda e: finetune(e, "i2", "task=rte,pe=rope"), "pe='tupe_r'"),
    Case("init_from_other_size", "init_from a run of another size",
         lambda e: finetune(e, "i3", model__hidden_size=64, model__mlp_dim=128), "model.hidden_size"),
    Case("longer_than_table", "input longer than the learned position table (max_len past the checkpoint's)",
         lambda e: finetune(e, "i4", model__max_len=128), "model.max_len"),
    Case("workdir_of_another_run", "workdir holding another run's config (says how to override)",
         lambda e: pretrain(e, "unused", **{}) [:2] + [f"--workdir={_other_run_workdir(e)}"]
         + pretrain(e, "unused")[3:], "--overwrite_config"),
    Case("tokenizer_mismatch", "tokenizer that does not match the checkpoint's",
         lambda e: finetune(e, "i5")[:2] + [f"--workdir={_mismatched_tokenizer_workdir(e)}"] + finetune(e, "i5")[3:],
         "tokenizer"),
    Case("evaluate_no_checkpoint", "`evaluate` on a workdir with no checkpoint",
         lambda e: ["evaluate", f"--workdir={_config_only_workdir(e, 'e1')}"], "no checkpoint"),
    Case("evaluate_no_workdir", "`evaluate` on a workdir that does not exist",
         lambda e: ["evaluate", f"--workdir={e.wd('e2')}"], "config.json"),
    Case("evaluate_bad_config_json", "`evaluate` on a workdir whose config.json is not JSON",
         lambda e: ["evaluate", f"--workdir={_config_only_workdir(e, 'e3', '{not json')}"], "config.json"),
    Case("evaluate_missing_step", "`evaluate --step` of a step that does not exist",
         lambda e: ["evaluate", f"--workdir={e.run}", "--step=99"], "step 99"),
    # ---------------------------------------------------------------- command line
    Case("unknown_flag", "unknown command-line flag", lambda e: pretrain(e, "c1") + ["--bogus"], "--bogus"),
    Case("unknown_command", "unknown command", lambda e: ["pretrian", f"--workdir={e.wd('c2')}"], "pretrian"),
    Case("override_without_config", "override given to a command that reads the workdir's config",
         lambda e: ["evaluate", f"--workdir={e.run}", "--config.train.steps=3"], "--config.train.steps"),
    Case("bad_lengths", "extrapolate with malformed --lengths",
         lambda e: ["extrapolate", f"--workdir={e.run}", "--lengths=128,abc"], "--lengths"),
    # ---------------------------------------------------------------- an existing run is never rewritten
    Case("resume_other_batch", "resume with another batch size (names the key and both values)",
         lambda e: [*pretrain(e, "base", train__batch_size=8)[:2], f"--workdir={_base(e)}",
                    *pretrain(e, "base", train__batch_size=8)[3:]], "train.batch_size=16 (this command: 8)"),
    Case("resume_other_lr", "resume with another learning rate",
         lambda e: [*pretrain(e, "base", train__learning_rate=0.5)[:2], f"--workdir={_base(e)}",
                    *pretrain(e, "base", train__learning_rate=0.5)[3:]], "train.learning_rate"),
    Case("resume_other_seed", "resume with another seed",
         lambda e: [*pretrain(e, "base", train__seed=7)[:2], f"--workdir={_base(e)}",
                    *pretrain(e, "base", train__seed=7)[3:]], "train.seed=0 (this command: 7)"),
    Case("resume_fewer_steps", "train.steps below the run's checkpoint step",
         lambda e: [*pretrain(e, "base", train__steps=1)[:2], f"--workdir={_base(e)}",
                    *pretrain(e, "base", train__steps=1)[3:]], "train.steps=1 would end before it"),
    Case("overwrite_trained_run", "--overwrite_config on a run with checkpoints",
         lambda e: [*pretrain(e, "base", "pe=rope")[:2], f"--workdir={_base(e)}", *pretrain(e, "base")[3:],
                    "--overwrite_config"], "--overwrite_config would misrepresent"),
    Case("finetune_into_pretraining_run", "fine-tune with --workdir = the pretraining run itself",
         lambda e: [*finetune(e, "x", "task=wordorder,pe=tupe_r")[:2], f"--workdir={_base(e)}",
                    *finetune(e, "x", "task=wordorder,pe=tupe_r", init_from=_base(e), model__max_len=32)[3:]],
         "holds a pretraining run; this command is a fine-tuning run"),
    Case("workdir_locked", "workdir in use by another live process",
         lambda e: pretrain(e, "x")[:2] + [f"--workdir={_locked(e)}"] + pretrain(e, "x")[3:], "is in use by process"),
    Case("workdir_is_file", "workdir that is a file",
         lambda e: pretrain(e, "x")[:2] + [f"--workdir={_write(e.data('a_file'), b'x')}"] + pretrain(e, "x")[3:],
         "is a file, not a folder"),
    Case("workdir_empty", "empty --workdir", lambda e: pretrain(e, "x")[:2] + ["--workdir="] + pretrain(e, "x")[3:],
         "--workdir is empty"),
    Case("workdir_not_writable", "workdir where nothing can be written (/proc)",
         lambda e: pretrain(e, "x")[:2] + ["--workdir=/proc/tupe_jax_run"] + pretrain(e, "x")[3:], "not writable"),
    Case("evaluate_edited_config", "`evaluate` on a run whose config.json was edited (max_len 64 -> 128)",
         lambda e: ["evaluate", f"--workdir={_copy_run(e, 'edited', lambda c: c['model'].update(max_len=128))}"],
         "does not match its checkpoint step 10"),
    Case("probe_edited_config", "`probe` on a run whose config.json was edited",
         lambda e: ["probe", f"--workdir={_copy_run(e, 'edited', lambda c: c['model'].update(max_len=128))}"],
         "does not match its checkpoint step 10"),
    Case("evaluate_finetune_run", "`evaluate` on a fine-tuning workdir",
         lambda e: ["evaluate", f"--workdir={_finetune_run(e)}"], "is a fine-tuning run (rte)"),
    Case("probe_finetune_run", "`probe` on a fine-tuning workdir",
         lambda e: ["probe", f"--workdir={_finetune_run(e)}"], "is a fine-tuning run (rte)"),
    Case("demo_on_other_run", "`demo` on a workdir that holds another run",
         lambda e: ["demo", f"--workdir={_other_run_workdir(e)}"], "resume with the run's settings"),
    # ---------------------------------------------------------------- inputs that make training meaningless
    Case("float16", "model.dtype=float16 (needs loss scaling)", lambda e: pretrain(e, "t1", model__dtype="float16"),
         "--config.model.dtype"),
    Case("mask_nothing_short", "MLM with max_len 2: no position can be masked",
         lambda e: pretrain(e, "t2", model__max_len=2), "masks no position"),
    Case("mask_nothing_rate", "MLM with mask_prob 0.001: no position is masked",
         lambda e: pretrain(e, "t3", data__mask_prob=0.001), "masks no position"),
    Case("classifier_on_causal", "GLUE fine-tuning of a causal LM ([CLS] at position 0 sees no text)",
         lambda e: finetune(e, "t4", "task=rte,pe=tupe_r,objective=clm"), "--config.model.objective"),
    Case("lr_inf", "learning_rate=inf", lambda e: pretrain(e, "t5", train__learning_rate="inf"),
         "train.learning_rate = inf is not a finite number"),
    Case("lr_nan", "learning_rate=nan", lambda e: pretrain(e, "t6", train__learning_rate="nan"),
         "--config.train.learning_rate"),
    Case("lr_negative", "negative learning rate", lambda e: pretrain(e, "t7", train__learning_rate=-1e-3),
         "--config.train.learning_rate"),
    Case("seed_negative", "negative seed", lambda e: pretrain(e, "t8", train__seed=-1), "--config.train.seed"),
    Case("seed_too_big", "seed beyond 64 bits", lambda e: pretrain(e, "t9", train__seed=2 ** 64),
         "--config.train.seed"),
    Case("adam_b1_one", "adam_b1 = 1", lambda e: pretrain(e, "t10", train__adam_b1=1.0), "--config.train.adam_b1"),
    Case("accum_not_dividing", "grad_accum_steps not dividing the batch",
         lambda e: pretrain(e, "t11", train__grad_accum_steps=3), "--config.train.grad_accum_steps"),
    Case("dropout_one", "dropout rate 1.0", lambda e: pretrain(e, "t12", model__dropout_rate=1.0),
         "--config.model.dropout_rate"),
    Case("rope_fraction_zero", "rope_fraction 0", lambda e: pretrain(e, "t13", "pe=rope", model__rope_fraction=0.0),
         "--config.model.rope_fraction"),
    Case("odd_buckets", "odd number of relative buckets", lambda e: pretrain(e, "t14", model__rel_num_buckets=7),
         "--config.model.rel_num_buckets"),
    Case("untie_cls_causal", "untie_cls in a causal model",
         lambda e: pretrain(e, "t15", "pe=tupe_r,objective=clm", model__untie_cls="true"), "--config.model.untie_cls"),
    Case("unknown_backend", "unknown attention backend", lambda e: pretrain(e, "t16", model__attention_backend="flash"),
         "--config.model.attention_backend"),
    Case("dropout_bits", "dropout mask width other than 32 or 16", lambda e: pretrain(e, "t16b", model__dropout_bits=8),
         "--config.model.dropout_bits"),
    Case("unknown_rope_style", "unknown rope style", lambda e: pretrain(e, "t17", "pe=rope", model__rope_style="spiral"),
         "--config.model.rope_style"),
    Case("unknown_tupe_form", "unknown TUPE form", lambda e: pretrain(e, "t18", model__tupe_form="sum"),
         "--config.model.tupe_form"),
    Case("max_predictions_too_big", "max_predictions above max_len",
         lambda e: pretrain(e, "t19", data__max_predictions=500), "--config.data.max_predictions"),
    Case("checkpoint_every_zero", "checkpoint.every = 0", lambda e: pretrain(e, "t20", checkpoint__every=0),
         "--config.checkpoint.every"),
    # ---------------------------------------------------------------- data, caches, GLUE files
    Case("cache_dir_is_file", "data.cache_dir that is a file",
         lambda e: pretrain(e, "c3", data__cache_dir=_write(e.data("cache_file"), b"x")), "is a file, not a folder"),
    Case("damaged_token_cache", "a truncated .npy in the data cache (names the file)",
         lambda e: pretrain(e, "c4", data__cache_dir=_damaged_cache(e)), "streams"),
    Case("glue_dev_header_only", "GLUE dev.tsv with a header and no rows",
         lambda e: finetune(e, "g7", data__glue_dir=_glue_copy(e, "glue_empty_dev", "rte", "dev", lambda ls: ls[:1])),
         "has a header and no rows"),
    Case("glue_no_dev", "GLUE task without dev.tsv (refused before training)",
         lambda e: finetune(e, "g8", data__glue_dir=_glue_drop(e, "glue_no_dev", "rte", "dev")), "validation"),
    Case("glue_buckets_strings", "non-numeric data.glue_buckets",
         lambda e: finetune(e, "g9", data__glue_buckets="('a',)"), "--config.data.glue_buckets"),
    Case("sweep_lrs_strings", "non-numeric sweep.learning_rates",
         lambda e: ["glue-sweep", *finetune(e, "g10", sweep__learning_rates="('a',)")[1:]],
         "--config.sweep.learning_rates"),
    Case("sweep_no_seeds", "empty sweep.seeds", lambda e: ["glue-sweep", *finetune(e, "g11", sweep__seeds="()")[1:]],
         "--config.sweep.seeds"),
    Case("sweep_unknown_task", "unknown task in sweep.tasks",
         lambda e: ["glue-sweep", *finetune(e, "g12", sweep__tasks="rte,squad")[1:]], "--config.sweep.tasks"),
    Case("warmup_ratio_one", "fine-tuning warmup_ratio 1.5", lambda e: finetune(e, "g13", train__warmup_ratio=1.5),
         "--config.train.warmup_ratio"),
    Case("eval_batch_not_dividing", "fine-tuning eval batch not divisible by the devices",
         lambda e: finetune(e, "g14", train__eval_batch_size=12), "--config.train.eval_batch_size"),
    # ---------------------------------------------------------------- analysis and comparison commands
    Case("extrapolate_beyond_memory", "extrapolate an ALiBi model to 100,000 tokens (memory estimated first)",
         lambda e: ["extrapolate", f"--workdir={e.alibi}", "--lengths=100000"], "GiB"),
    Case("extrapolate_zero_length", "extrapolate with a zero length",
         lambda e: ["extrapolate", f"--workdir={e.run}", "--lengths=0"], "--lengths"),
    Case("extrapolate_sliding_mlm", "sliding windows on an MLM",
         lambda e: ["extrapolate", f"--workdir={e.run}", "--lengths=32", "--mode=sliding"], "--mode"),
    Case("out_is_file", "--out pointing at an existing file",
         lambda e: ["probe", f"--workdir={e.run}", f"--out={_write(e.data('out_file'), b'x')}"], "--out"),
    Case("probe_steps_zero", "probe with --probe_steps=0", lambda e: ["probe", f"--workdir={e.run}", "--probe_steps=0"],
         "--probe_steps"),
    Case("shuffle_text_short", "shuffle-attention on a one-word text",
         lambda e: ["shuffle-attention", f"--workdir={e.run}", "--text=."], "--text"),
    Case("compare_unknown_suite", "unknown comparison suite",
         lambda e: ["compare", f"--config={os.path.join(ROOT, 'configs', 'compare.py')}:suite=nope",
                    f"--workdir={e.wd('cmp1')}"], "suite"),
    Case("compare_unknown_scheme", "unknown scheme in a suite",
         lambda e: ["compare", f"--config={os.path.join(ROOT, 'configs', 'compare.py')}",
                    f"--workdir={e.wd('cmp2')}", "--config.schemes=bert_a,fourier"], "--config.schemes"),
    Case("compare_tiedcls_causal", "tied-[CLS] variant of a causal scheme",
         lambda e: ["compare", f"--config={os.path.join(ROOT, 'configs', 'compare.py')}",
                    f"--workdir={e.wd('cmp3')}", "--config.schemes=alibi-clm-tiedcls"], "--config.schemes"),
    Case("compare_glue_without_dir", "a suite's GLUE task without data.glue_dir",
         lambda e: ["compare", f"--config={os.path.join(ROOT, 'configs', 'compare.py')}:suite=tupe",
                    f"--workdir={e.wd('cmp4')}", "--config.glue.tasks=rte"], "--config.data.glue_dir"),
    # ---------------------------------------------------------------- import-fairseq (issue #19)
    Case("fairseq_no_from", "import-fairseq without --from", lambda e: ["import-fairseq", f"--workdir={e.wd('f1')}"],
         "--from"),
    Case("fairseq_missing", "import-fairseq --from a folder that does not exist",
         lambda e: ["import-fairseq", f"--from={e.data('nowhere')}", f"--workdir={e.wd('f2')}"], "does not exist"),
    Case("fairseq_no_dict", "fairseq checkpoint folder without dict.txt",
         lambda e: ["import-fairseq", f"--from={_fairseq_no_dict(e)}", f"--workdir={e.wd('f3')}"], "has no dict.txt"),
    Case("fairseq_not_a_checkpoint", "a .pt that is not a PyTorch checkpoint",
         lambda e: ["import-fairseq", f"--from={_not_a_checkpoint(e)}", f"--workdir={e.wd('f4')}"],
         "is not a PyTorch checkpoint"),
    Case("fairseq_unsafe_pickle", "a .pt holding an object outside the safe-load allowlist (would call open())",
         lambda e: _import_fairseq(e, _fairseq_ckpt(e, "fairseq_evil", extra={"x": _OpensAFile(e.data("pwned"))}),
                                   "f5"), "not on the allowlist"),
    Case("fairseq_pre_ln", "fairseq checkpoint with pre-LN blocks (--encoder-normalize-before)",
         lambda e: _import_fairseq(e, _fairseq_ckpt(e, "fairseq_preln", args={"encoder_normalize_before": True}),
                                   "f6"), "encoder_normalize_before=True"),
    Case("fairseq_learned_positions", "fairseq checkpoint with a learned input position table (upstream BERT/RoBERTa)",
         lambda e: _import_fairseq(e, _fairseq_ckpt(e, "fairseq_learned", tensors=_learned_table()), "f7"),
         "embed_positions.weight"),
    Case("override_no_value", "override with no value at the end of the line",
         lambda e: pretrain(e, "o1") + ["--config.train.steps"], "--config.train.steps"),
    Case("tuple_override_scalar", "a scalar where a tuple is expected",
         lambda e: finetune(e, "o2", data__glue_buckets="32"), "--config.data.glue_buckets"),
]
CASE_BY_NAME = {c.name: c for c in CASES}
RECORDS: dict[str, tuple[str, str, str]] = {}   # name -> (what, command, message), for docs/errors.md


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("errors"))
    cache = os.path.join(tmp, "cache")
    old = os.environ.get("TUPE_JAX_CACHE")
    os.environ["TUPE_JAX_CACHE"] = cache
    glue = os.path.join(tmp, "data", "glue")
    write_glue_dir(glue)
    run = os.path.join(tmp, "data", "run")
    make_pretrained(run, cache, pe="tupe_r")
    alibi = os.path.join(tmp, "data", "alibi")
    make_pretrained(alibi, cache, pe="alibi")
    env = Env(tmp, cache, glue, run, alibi)
    yield env
    for holder in env.holders:
        holder.kill()
        holder.wait()
    if old is None:
        os.environ.pop("TUPE_JAX_CACHE", None)
    else:
        os.environ["TUPE_JAX_CACHE"] = old
    _maybe_write_doc(tmp)


def _tree(path: str) -> dict[str, str] | None:
    """{relative path: sha1} of every file under `path` (None if it does not exist)."""
    if not os.path.exists(path):
        return None
    out = {}
    for root, dirs, files in os.walk(path):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), path) + "/"] = ""
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha1(f.read()).hexdigest()
    return out


def _workdir_of(argv: list[str]) -> str | None:
    return next((a.split("=", 1)[1] for a in argv if a.startswith("--workdir=")), None)


def check_one_line(err: str, needle: str) -> str:
    """The stderr of a failed command holds exactly one `error:` line (the last), naming `needle`; no traceback."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert needle in errors[0], errors[0]
    return errors[0]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case, env, capsys):
    _run_case(case, env, capsys)


def _run_case(case: Case, env: Env, capsys) -> None:
    """Run one catalogue case in-process, check its one-line error and untouched workdir, record it for the doc."""
    argv = case.argv(env)
    workdir = _workdir_of(argv)
    before = _tree(workdir) if workdir else None
    capsys.readouterr()
    code = launch.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    message = check_one_line(err, case.needle)
    if workdir:   # no partial outputs: the workdir is exactly as before (absent if it was absent)
        assert _tree(workdir) == before, (workdir, _tree(workdir), before)
    shown = [a for a in argv if a not in _base_overrides(env)]
    shown += ["[tiny]"] if len(shown) < len(argv) else []
    RECORDS[case.name] = (case.what, _display(" ".join(["python -m launch", *shown]), env.tmp),
                          _display(message, env.tmp))


def _base_overrides(env: Env) -> set[str]:
    """The tiny-model / cache overrides every pretrain/finetune case carries (shown as [tiny] in the docs)."""
    return set(pretrain(env, "x")[3:]) | set(finetune(env, "x")[3:])


def test_case_names_and_descriptions_are_unique():
    """Each case is one row of docs/errors.md: a duplicate name would silently drop a case from CASE_BY_NAME and
    RECORDS, a duplicate description would make two rows read the same."""
    names, whats = [c.name for c in CASES], [c.what for c in CASES]
    assert sorted(set(names)) == sorted(names) and sorted(set(whats)) == sorted(whats)
    assert "longer_than_table_api" not in names  # the library-API record's key


def test_longer_than_table_in_the_library_api():
    """Straight through the model: an input longer than a learned table is a UserError naming model.max_len."""
    _run_longer_than_table_api()


def _run_longer_than_table_api() -> None:
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from tupe_jax.errors import UserError  # pylint: disable=import-outside-toplevel
    from tupe_jax.model import ModelConfig, TransformerLM  # pylint: disable=import-outside-toplevel
    import ml_collections  # pylint: disable=import-outside-toplevel
    from configs import pretrain as pretrain_config  # pylint: disable=import-outside-toplevel

    config = pretrain_config.get_config("pe=bert_a")
    model_cfg = dict(config.model.to_dict(), **{k.split(".")[1]: v for k, v in TINY_MODEL.items()})
    model_cfg["max_len"] = 16
    model = TransformerLM(ModelConfig.from_config(ml_collections.ConfigDict(model_cfg)))
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    with pytest.raises(UserError) as info:
        model.apply({"params": params}, jnp.zeros((1, 17), jnp.int32))
    message = str(info.value)
    assert message.startswith("error:") and "\n" not in message and "model.max_len" in message
    RECORDS["longer_than_table_api"] = ("input longer than a learned table (library API, `TransformerLM.apply`)",
                                        "TransformerLM(pe=bert_a, max_len=16).apply(ids of length 17)", message)


# A few cases as real `python -m launch` processes: the same one line on stderr, exit 2, no traceback.
END_TO_END = ["mistyped_key", "non_utf8", "glue_bad_label", "evaluate_no_checkpoint", "fairseq_unsafe_pickle"]


@pytest.mark.parametrize("name", END_TO_END)
def test_bad_input_end_to_end(name, env):
    case = CASE_BY_NAME[name]
    argv = case.argv(env)   # same workdirs as in-process: the catalogue leaves them exactly as they were
    workdir = _workdir_of(argv)
    before = _tree(workdir) if workdir else None
    proc = subprocess.run([sys.executable, "-m", "launch", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, TUPE_JAX_CACHE=env.cache), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    check_one_line(proc.stderr, case.needle)
    if workdir:
        assert _tree(workdir) == before


# ------------------------------------------------------------------------------------------------ docs/errors.md
def _display(text: str, tmp: str) -> str:
    text = text.replace(os.path.join(tmp, "wd") + os.sep, "runs/").replace(os.path.join(tmp, "data") + os.sep, "data/")
    text = text.replace(tmp + os.sep, "").replace(ROOT + os.sep, "")
    # what changes from run to run (a lock holder's pid, host, start time and command; this machine's memory)
    text = re.sub(r"process \d+ on \S+ \(started [^)]*\)", "process PID on HOST (started TIME: COMMAND)", text)
    return re.sub(r"this machine has [\d.]+ GiB available", "this machine has N GiB available", text)


def _cell(text: str) -> str:
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"


DOC_ORDER = [c.name for c in CASES] + ["longer_than_table_api"]
DOC_PATH = os.path.join(ROOT, "docs", "errors.md")


def _maybe_write_doc(tmp: str) -> None:
    path = os.environ.get("TUPE_JAX_ERRORS_DOC")
    if not path:
        return
    missing = [n for n in DOC_ORDER if n not in RECORDS]
    if missing:   # a partial run (e.g. -k) must not overwrite the full table
        print(f"not writing {path}: cases not run: {missing}", file=sys.stderr)
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_errors_doc())
    print(f"wrote {path} ({len(DOC_ORDER)} cases)", file=sys.stderr)


def render_errors_doc() -> str:
    """The text of docs/errors.md from RECORDS (every name in DOC_ORDER must have been run)."""
    order = DOC_ORDER
    lines = ["# Errors: the catalogue of bad inputs", "",
             "Generated by `python tools/gen_errors_doc.py` from `tests/test_errors_catalogue.py`; do not edit by",
             "hand. Every case exits with status 2 and prints exactly one line `error: <what>, <where>, <what to",
             "do>` on stderr (no traceback) and leaves no partial outputs behind: the test hashes every file of the",
             "workdir before and after each case and requires them byte-identical. `runs/` and `data/` stand for the",
             "test's temporary workdirs and inputs; `[tiny]` stands for the tiny-model overrides each test command carries",
             "(`--config.model.hidden_size=32 ...`, see `pretrain()` / `finetune()` in the test).", "",
             "| # | bad input | command | message |", "|---|---|---|---|"]
    for i, name in enumerate(order, 1):
        what, command, message = RECORDS[name]
        lines.append(f"| {i} | {what} | {_cell(command)} | {_cell(message)} |")
    lines += ["", "Runtime failures with their own tests (`tests/test_reliability.py`, `tests/test_workdir.py`, "
              "`tests/test_lock.py`, `tests/test_launch.py`):", "",
              "| failure | behaviour |", "|---|---|",
              "| NaN/Inf loss, gradients or parameters | `error: training diverged at step N (...)`, exit 2; the last good "
              "checkpoint is kept |",
              "| disk full during a checkpoint save | `error: disk full: could not write checkpoint step N (...)`, exit 2;"
              " the unfinished step is removed, committed checkpoints are intact |",
              "| corrupt or truncated latest checkpoint | warning naming the bad step, restore falls back to the previous "
              "good one, nothing deleted (a later save of that step first moves it to `<step>.bad-<time>`) |",
              "| kill -9 (also during an asynchronous save) | the unfinished `<step>.orbax-checkpoint-tmp` is never "
              "restored; the restart resumes bitwise-exactly from the last committed step |",
              "| SIGTERM | the current step is checkpointed and committed, exit 0 |",
              "| a second process on a workdir in use | `error: <workdir> is in use by process PID on HOST ...`, exit 2, "
              "before it reads the run's checkpoints, nothing written; the lock of a killed run dies with it and the "
              "next command takes it over |",
              "| resume with an allowed change (steps, intervals, checkpointing, mesh, data loading) | accepted; the "
              "change is recorded in `config_history.jsonl` and printed |",
              "| any unexpected exception | `error: unexpected <Type>: <message>, <workdir>/logs/error-*.log, ...`, exit "
              "1; the log holds the traceback; what the command created is removed unless it holds checkpoints |", ""]
    return "\n".join(lines)


def test_docs_errors_md_matches_the_catalogue(env, capsys):
    """docs/errors.md is what `python tools/gen_errors_doc.py` would write now: the table regenerated in memory from
    the messages the cases actually print equals the file on disk (after the whole module the records are all
    there; under -k the missing cases are run here). On a mismatch, rerun the generator and review the diff."""
    if os.environ.get("TUPE_JAX_ERRORS_DOC"):
        pytest.skip("tools/gen_errors_doc.py is rewriting the file from this run")
    for case in CASES:
        if case.name not in RECORDS:
            _run_case(case, env, capsys)
    if "longer_than_table_api" not in RECORDS:
        _run_longer_than_table_api()
    assert [n for n in DOC_ORDER if n not in RECORDS] == []
    with open(DOC_PATH, encoding="utf-8") as f:
        on_disk = f.read()
    generated = render_errors_doc()
    if generated != on_disk:
        import difflib  # pylint: disable=import-outside-toplevel
        diff = "\n".join(difflib.unified_diff(on_disk.splitlines(), generated.splitlines(), "docs/errors.md",
                                                "regenerated", lineterm="", n=0))
        pytest.fail("docs/errors.md is stale; run `python tools/gen_errors_doc.py`:\n" + diff[:6000])
