"""The catalogue of bad inputs (issue #8): each gives ONE line `error: ...` naming the key, file or line, exit 2, no
traceback, and leaves no partial outputs behind.

Cases run in-process through `launch.main(argv)` (what `python -m launch` calls); a few also run as real
subprocesses to prove the end-to-end behaviour. `python tools/gen_errors_doc.py` reruns this file with
TUPE_JAX_ERRORS_DOC set and writes docs/errors.md (the table of cases and messages) from the CASES below.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
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
    yield Env(tmp, cache, glue, run)
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
END_TO_END = ["mistyped_key", "non_utf8", "glue_bad_label", "evaluate_no_checkpoint"]


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
    return text


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
             "Generated by `python tools/gen_errors_doc.py` from `tests/test_errors_catalogue.py` (issue #8); do not",
             "edit by hand. Every case exits with status 2 and prints exactly one line `error: <what>, <where>, <what to",
             "do>` on stderr (no traceback) and leaves no partial outputs behind. `runs/` and `data/` stand for the",
             "test's temporary workdirs and inputs; `[tiny]` stands for the tiny-model overrides each test command carries",
             "(`--config.model.hidden_size=32 ...`, see `pretrain()` / `finetune()` in the test).", "",
             "| # | bad input | command | message |", "|---|---|---|---|"]
    for i, name in enumerate(order, 1):
        what, command, message = RECORDS[name]
        lines.append(f"| {i} | {what} | {_cell(command)} | {_cell(message)} |")
    lines += ["", "Runtime failures with their own tests in `tests/test_reliability.py`:", "",
              "| failure | behaviour |", "|---|---|",
              "| NaN/Inf loss, gradients or parameters | `error: training diverged at step N (...)`, exit 2; the last good "
              "checkpoint is kept |",
              "| disk full during a checkpoint save | `error: disk full: could not write checkpoint step N (...)`, exit 2;"
              " the unfinished step is removed, committed checkpoints are intact |",
              "| corrupt or truncated latest checkpoint | warning naming the bad step, restore falls back to the previous "
              "good one, nothing deleted (a later save of that step first moves it to `<step>.bad-<time>`) |",
              "| kill -9 (also during an asynchronous save) | the unfinished `<step>.orbax-checkpoint-tmp` is never "
              "restored; the restart resumes bitwise-exactly from the last committed step |",
              "| SIGTERM | the current step is checkpointed and committed, exit 0 |", ""]
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
