"""The catalogue of bad inputs (issue #8): each gives ONE line `error: ...` naming the key, file or line, exit 2, no
traceback, and leaves no partial outputs behind.

The cases (tests/errors_cases.py, built from tests/errors_inputs.py) run in-process through `launch.main(argv)`
(what `python -m launch` calls); a few also run as real subprocesses to prove the end-to-end behaviour. `python
tools/gen_errors_doc.py` reruns this file with TUPE_JAX_ERRORS_DOC set and writes docs/errors.md (the table of
cases and messages, tests/errors_doc.py) from the messages observed here.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

import launch
from errors_cases import CASE_BY_NAME, CASES, Case
from errors_doc import DOC_ORDER, DOC_PATH, RECORDS, display, maybe_write_doc, render_errors_doc
from errors_inputs import ROOT, TINY_MODEL, Env, finetune, pretrain
from glue_fixtures import make_pretrained, write_glue_dir


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
    maybe_write_doc(tmp)


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


def _folders(workdir: str | None, argv: list[str]) -> list[str]:
    """Every folder under the workdir and an `--out` (`_tree` lists files only)."""
    roots = [workdir] + [a.split("=", 1)[1] for a in argv if a.startswith("--out=")]
    return sorted(os.path.join(r, d) for root in roots if root and os.path.isdir(root)
                  for r, dirs, _ in os.walk(root) for d in dirs) + [r for r in roots if r and os.path.isdir(r)]


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
    folders = _folders(workdir, argv)
    capsys.readouterr()
    code = launch.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    message = check_one_line(err, case.needle)
    if workdir:   # no partial outputs: the workdir is exactly as before (absent if it was absent)
        assert _tree(workdir) == before, (workdir, _tree(workdir), before)
    assert _folders(workdir, argv) == folders       # nor an empty folder (an analysis's output folder, say)
    shown = [a for a in argv if a not in _base_overrides(env)]
    shown += ["[tiny]"] if len(shown) < len(argv) else []
    RECORDS[case.name] = (case.what, display(" ".join(["python -m launch", *shown]), env.tmp),
                          display(message, env.tmp))


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
END_TO_END = ["mistyped_key", "non_utf8", "glue_bad_label", "evaluate_no_checkpoint", "fairseq_unsafe_pickle",
              "evaluate_damaged_checkpoint"]


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
