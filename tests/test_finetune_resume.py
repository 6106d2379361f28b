"""A GLUE fine-tune resumed from its own checkpoints: without its init_from run (a continued pretraining already
resumed so), and on another number of processes."""
import json
import os
import shutil

import pytest

from tests.glue_fixtures import glue_env, make_config
from tupe_jax.finetune import loop as ft_loop


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return glue_env(tmp_path_factory.mktemp("glue_env"))


def test_a_resume_on_another_process_count_warns_and_marks_its_row(env, tmp_path, capsys):
    """A fine-tune resumed on another number of processes takes each step's examples as before, in another row
    order: it says so (once, and in its `resumed` row). A checkpoint saved by two processes is made by editing the
    count its progress records."""
    config = make_config(env, "rte", steps=16)
    config.checkpoint.every = 8
    ft_loop.finetune(config, str(tmp_path / "ft"))
    shutil.rmtree(tmp_path / "ft" / "checkpoints" / "16")
    os.remove(tmp_path / "ft" / "results.json")
    (saved,) = [p for p in (tmp_path / "ft" / "checkpoints" / "8").rglob("*")
                if p.is_file() and b'"process_count": 1' in p.read_bytes()]
    saved.write_bytes(saved.read_bytes().replace(b'"process_count": 1', b'"process_count": 2'))
    capsys.readouterr()
    ft_loop.finetune(config, str(tmp_path / "ft"))
    out = capsys.readouterr().out
    assert out.count("ran on 2 processes and resumes on 1: each step takes the same examples") == 1
    rows = [json.loads(line) for line in open(tmp_path / "ft" / "metrics.jsonl")]
    assert [r for r in rows if r.get("event") == "resumed"] == [
        {"step": 8, "event": "resumed", "process_count_before": 2, "process_count": 1}]


def test_a_resume_needs_no_init_from_run(env, tmp_path, capsys):
    """The pretraining run a fine-tune started from was opened on every start: a resume after it was moved or
    deleted (a bucket's retention, a cleaned-up disk) failed. The run's own checkpoint and its copy of the tokenizer
    are all a resume reads; results.json still names the step it started from."""
    source = tmp_path / "pre"
    shutil.copytree(env["pre"], source)
    config = make_config(env, "rte", steps=16)
    config.init_from, config.checkpoint.every = str(source), 8
    straight = ft_loop.finetune(config, str(tmp_path / "ft"))
    shutil.rmtree(tmp_path / "ft" / "checkpoints" / "16")      # stopped after its step-8 checkpoint
    os.remove(tmp_path / "ft" / "results.json")
    shutil.rmtree(source)
    capsys.readouterr()
    again = ft_loop.finetune(config, str(tmp_path / "ft"))
    assert "resumed rte from step 8" in capsys.readouterr().out
    assert again["final"]["metrics"] == straight["final"]["metrics"]
    saved = json.load(open(tmp_path / "ft" / "results.json"))
    assert saved["init_from"] == str(source) and saved["init_step"] == straight["init_step"] is not None
