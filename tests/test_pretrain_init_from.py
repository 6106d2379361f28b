"""`pretrain --config.init_from=RUN`: a fresh run that starts at RUN's params, with RUN's model keys and tokenizer,
and a fresh optimizer, schedule and data order; refused in one line, with nothing written, where it cannot."""
import json
import os
import re

import jax
import numpy as np
import pytest

import launch
from tests.glue_fixtures import make_pretrained
from tests.workdir_fixtures import tree
from tupe_jax import checkpoint as ckpt
from tupe_jax import workdir as workdir_lib


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny bert_a run (not the config file's default scheme, nor its default sizes) at steps 10 and 20, with
    other params at each."""
    import jax.numpy as jnp
    import optax
    from tupe_jax.model import ModelConfig, init_params
    root = tmp_path_factory.mktemp("source")
    at_10 = make_pretrained(root / "run", root / "cache", pe="bert_a", steps=(10,))
    config = workdir_lib.read_config(str(root / "run"))
    params = init_params(ModelConfig.from_config(config.model), jax.random.PRNGKey(2))
    with ckpt.Checkpointer(str(root / "run"), async_=False) as c:
        c.save(20, {"step": jnp.int32(20), "params": params, "opt_state": optax.adamw(1e-3).init(params),
                    "rng": jax.random.PRNGKey(0)}, data_state={}, meta=workdir_lib.make_meta(config, params), force=True)
    return {"run": str(root / "run"), "cache": str(root / "cache"), "params": params, "params_10": at_10}


def same(a, b):
    return jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) and all(
        np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def continue_argv(source, workdir, *more):
    return ["pretrain", "--config=configs/pretrain.py", f"--workdir={workdir}", f"--config.init_from={source['run']}",
            f"--config.data.cache_dir={source['cache']}", "--config.train.batch_size=8",
            "--config.train.log_every=1", "--config.train.eval_every=0", "--config.checkpoint.async_save=False",
            *more]


def params_at(workdir, step):
    return workdir_lib.load_run(str(workdir), step).params


def test_a_continued_run_starts_at_the_source_params_and_keeps_its_tokenizer(source, tmp_path, capsys):
    """At a learning rate of 0 for the first step (warmup from 0), the params after it are the source's bitwise:
    every param was read (the MLM head too), onto the model of the source's keys (bert_a, its sizes)."""
    run = tmp_path / "run"
    before = tree(source["run"])
    assert launch.main(continue_argv(source, run, "--config.train.steps=1", "--config.train.warmup_steps=1",
                                     "--config.train.decay_steps=3")) == 0
    assert tree(source["run"]) == before
    out = capsys.readouterr().out
    assert "model.pe='bert_a'" in out and f"every param from {source['run']} step 20" in out
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["pe"] == "bert_a" and config["model"]["hidden_size"] == 32
    assert config["init_from"] == source["run"]
    want = jax.tree_util.tree_map(np.asarray, source["params"])
    assert same(params_at(run, 1), want)
    src_vocab = os.path.join(source["run"], "tokenizer", "vocab.txt")
    assert (run / "tokenizer" / "vocab.txt").read_text() == open(src_vocab, encoding="utf-8").read()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 0, "event": "init_from", "init_from": source["run"], "init_step": 20} in rows
    meta = ckpt.Checkpointer(str(run), read_only=True).restore_meta(1)
    assert meta["pe"] == "bert_a" and not meta.get("fresh_mlm_head")

    # it then trains (the source's params move) and resumes from its own checkpoint, not the source's
    assert launch.main(continue_argv(source, run, "--config.train.steps=3", "--config.train.warmup_steps=1",
                                     "--config.train.decay_steps=3", "--config.checkpoint.every=1")) == 0
    out = capsys.readouterr().out
    assert "resumed from step 1" in out and "every param from" not in out
    assert not same(params_at(run, 3), want)


def test_init_step_picks_the_source_step_and_a_resume_needs_no_source(source, tmp_path, capsys):
    """The params at init_step's checkpoint (not the newest's); once the run has a checkpoint of its own, it resumes
    without the source: the model keys come from its own config.json (a resume had to find the source again)."""
    import shutil
    copy, run = tmp_path / "source", tmp_path / "run"
    shutil.copytree(source["run"], copy)
    argv = continue_argv({**source, "run": str(copy)}, run, "--config.train.steps=1", "--config.train.warmup_steps=1",
                         "--config.train.decay_steps=3", "--config.init_step=10")
    assert launch.main(argv) == 0
    assert f"every param from {copy} step 10" in capsys.readouterr().out
    assert same(params_at(run, 1), jax.tree_util.tree_map(np.asarray, source["params_10"]))
    assert not same(params_at(run, 1), jax.tree_util.tree_map(np.asarray, source["params"]))
    again = [a.replace("train.steps=1", "train.steps=2") for a in argv]
    before = tree(str(run))
    assert launch.main([a.replace("init_step=10", "init_step=20") for a in again]) == 2   # it read step 10
    assert capsys.readouterr().err.startswith(f"error: {run / 'config.json'} holds a run with init_step=10 (this "
                                              "command: 20)")
    assert tree(str(run)) == before
    shutil.rmtree(copy)
    assert launch.main(again) == 0
    assert "resumed from step 1" in capsys.readouterr().out and params_at(run, 2) is not None


def test_a_run_inside_the_source_folder_is_refused(source, tmp_path, capsys):
    before = tree(source["run"])
    inside = os.path.join(source["run"], "more")
    assert launch.main(continue_argv(source, inside, "--config.train.steps=1")) == 2
    assert capsys.readouterr().err.startswith(f"error: --workdir {inside} is inside the folder of init_from's run")
    assert tree(source["run"]) == before


@pytest.mark.parametrize("more,message", [
    (("--config.model.num_layers=3",), r"init_from .* was pretrained with model.num_layers=2 but this config has "
                                       r"model.num_layers=3, --config.init_from, leave those keys off"),
    (("--config.data.vocab_file=VOCAB",), r"data.vocab_file given with init_from: a continued run keeps the "
                                          r"tokenizer of the run it continues, --config.data.vocab_file, drop"),
    (("--config.init_step=15",), r"no checkpoint at step 15 in .*, use one of \[10, 20\]"),
])
def test_what_cannot_continue_is_one_line_and_writes_nothing(source, tmp_path, capsys, more, message):
    vocab = os.path.join(source["run"], "tokenizer", "vocab.txt")
    run = tmp_path / "run"
    before = tree(source["run"])
    argv = continue_argv(source, run, "--config.train.steps=1", *(m.replace("VOCAB", vocab) for m in more))
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert not run.exists() and tree(source["run"]) == before


def test_a_run_from_scratch_does_not_continue_another(source, tmp_path, capsys):
    """init_from is what a run IS: a run made without it is not resumed with it (the gate names the key)."""
    run = tmp_path / "run"
    scratch = ["pretrain", "--config=configs/pretrain.py:pe=bert_a", f"--workdir={run}",
               f"--config.data.cache_dir={source['cache']}", "--config.train.steps=1", "--config.train.batch_size=8",
               "--config.model.num_layers=2", "--config.model.hidden_size=32", "--config.model.num_heads=2",
               "--config.model.mlp_dim=64", "--config.model.vocab_size=512", "--config.model.max_len=64",
               "--config.checkpoint.async_save=False"]
    assert launch.main(scratch) == 0
    before = tree(str(run))
    capsys.readouterr()
    assert launch.main(scratch[:3] + [f"--config.init_from={source['run']}"] + scratch[3:]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run / 'config.json'} holds a run with init_from=''"), err
    assert tree(str(run)) == before


def test_a_prepared_corpus_of_another_tokenizer_is_refused_and_the_checkpointer_closed(source, tmp_path, capsys,
                                                                                       monkeypatch):
    """The records' ids would be read as the ids of init_from's vocabulary. The refusal comes once the run's
    checkpointer is open: it is closed on the way out (it was left open, with its threads)."""
    from tests.test_data_prepare import prepare_args, write_corpus  # pylint: disable=import-outside-toplevel
    prepared, run = tmp_path / "prepared", tmp_path / "run"
    assert launch.main(prepare_args(write_corpus(tmp_path / "corpus"), prepared, max_len=64)) == 0
    closed, close = [], ckpt.Checkpointer.close
    monkeypatch.setattr(ckpt.Checkpointer, "close", lambda self: closed.append(self.directory) or close(self))
    before = tree(source["run"])
    capsys.readouterr()
    argv = continue_argv(source, run, "--config.train.steps=1", "--config.data.name=prepared",
                         f"--config.data.path={prepared}")
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {prepared} was prepared with another tokenizer than init_from's") and \
        err.count("\n") == 1, err
    assert [d for d in closed if str(run) in str(d)] and not run.exists() and tree(source["run"]) == before
