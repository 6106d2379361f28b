"""A GLUE fine-tune resumed from its own checkpoints: without its init_from run (a continued pretraining already
resumed so), and on another number of processes."""
import json
import os
import shutil

import pytest

import launch
from tests.glue_fixtures import glue_env, make_config
from tests.workdir_fixtures import tree
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


@pytest.mark.slow   # a sweep of two 4-step fine-tunes through the launcher, then one resumed
def test_a_sweep_whose_sub_runs_have_started_needs_no_init_from_run(env, tmp_path, capsys):
    """A glue-sweep resolved init_from on every start, so a sweep preempted after its source was deleted could not
    finish, though no sub-run left needed the source. A sub-run not started yet still needs it, and says so."""
    source, sweep = tmp_path / "pre", tmp_path / "sweep"
    shutil.copytree(env["pre"], source)
    argv = ["glue-sweep", "--config=configs/glue.py:task=rte", f"--workdir={sweep}",
            f"--config.init_from={source}", f"--config.data.glue_dir={env['glue']}",
            f"--config.data.cache_dir={env['root'] / 'cache'}", "--config.data.glue_buckets=(32,64)",
            "--config.train.steps=4", "--config.train.batch_size=16", "--config.train.eval_batch_size=16",
            "--config.train.predict_test=false", "--config.checkpoint.every=2", "--config.checkpoint.async_save=false",
            "--config.sweep.learning_rates=(0.001,)", "--config.sweep.seeds=(0,1)"]
    assert launch.main(argv) == 0
    first = (sweep / "sweep.json").read_text()
    seed1 = sweep / "rte" / "lr=0.001" / "seed=1"
    shutil.rmtree(seed1 / "checkpoints" / "4")             # preempted after its step-2 checkpoint
    os.remove(seed1 / "results.json")
    shutil.rmtree(source)
    capsys.readouterr()
    assert launch.main(argv) == 0
    out = capsys.readouterr().out
    assert (f"note: init_from {source} does not exist; every sub-run has started, so the sweep goes on without it, "
            f"from {source} step 10 as they recorded") in out and "resumed rte from step 2" in out
    assert (sweep / "sweep.json").read_text() == first      # the resumed sub-run ends as it did uninterrupted
    before = tree(str(sweep))
    assert launch.main(argv + ["--config.init_step=5"]) == 2   # a pinned step must be the one they recorded
    assert "the sub-runs started from" in capsys.readouterr().err and tree(str(sweep)) == before
    source.mkdir()                                           # a folder there now that is no pretraining run
    assert launch.main(argv) == 2
    assert "is not a pretraining run" in capsys.readouterr().err and tree(str(sweep)) == before
    source.rmdir()
    shutil.rmtree(seed1)                                     # a sub-run not started needs the source
    before = tree(str(sweep))
    assert launch.main(argv) == 2
    assert f"error: init_from {source} does not exist" in capsys.readouterr().err
    assert tree(str(sweep)) == before
    shutil.copytree(env["pre"], source)        # the run trained again into its folder: another step-10 checkpoint
    saved = source / "checkpoints" / "10" / "_CHECKPOINT_METADATA"
    record = json.loads(saved.read_text())
    saved.write_text(json.dumps({**record, "commit_timestamp_nsecs": record["commit_timestamp_nsecs"] + 1}))
    assert launch.main(argv) == 2              # the finished sub-run's scores are of weights no longer there
    assert f"started from {source} step 10 as saved then, and that checkpoint is another one now" in \
        capsys.readouterr().err
    assert tree(str(sweep)) == before


def test_a_finished_fine_tune_is_not_resumed_again(env, tmp_path, capsys):
    """A rerun of a finished fine-tune said "resumed rte from step 8", added a `resumed` row to metrics.jsonl and
    wrote results.json again."""
    config = make_config(env, "rte", steps=8)
    first = ft_loop.finetune(config, str(tmp_path / "ft"))
    kept = {name: (tmp_path / "ft" / name).read_bytes() for name in ("metrics.jsonl", "results.json")}
    capsys.readouterr()
    assert ft_loop.finetune(config, str(tmp_path / "ft")) == json.loads(json.dumps(first))
    out = capsys.readouterr().out
    assert "finished its 8 steps before: nothing to train" in out and "resumed" not in out
    assert {name: (tmp_path / "ft" / name).read_bytes() for name in kept} == kept
