"""GLUE fine-tuning end to end on tiny models: params-only restore, refusing other schemes/sizes, the nine layouts,
submission files, resume, the word-order task's fine-tune machinery, a fixture pair task beating the majority
class, and the sweep."""
import json
import os
import shutil

import jax
import numpy as np
import pytest

from tests.glue_fixtures import DIRS, TINY, glue_env, load_config_module, make_config
from tupe_jax import checkpoint as ckpt
from tupe_jax import data as data_lib
from tupe_jax import workdir as workdir_lib
from tupe_jax.finetune import init_from as ft_init
from tupe_jax.finetune import loop as ft_loop
from tupe_jax.finetune import runner as ft_runner
from tupe_jax.finetune import scores
from tupe_jax.finetune import sweep as ft_sweep
from tupe_jax.finetune import validate as ft_validate
from tupe_jax.errors import UserError

GLUE_CFG = load_config_module("glue")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return glue_env(tmp_path_factory.mktemp("glue_env"))


def test_config_mirrors_pretraining_and_validates():
    pre = load_config_module("pretrain").get_config("pe=bert_a,size=small")
    cfg = GLUE_CFG.get_config("task=mnli,pe=bert_a,size=small")
    assert cfg.model.to_dict() == pre.model.to_dict()
    assert cfg.train.batch_size == 32 and cfg.train.warmup_ratio == 0.06 and cfg.init_from == ""
    assert tuple(cfg.sweep.learning_rates) == (2e-5, 3e-5, 4e-5, 5e-5) and len(cfg.sweep.seeds) == 5
    assert [ft_validate.paper_epochs(t) for t in ("mnli", "qnli", "qqp", "rte", "cola")] == [5, 5, 5, 10, 10]
    ft_validate.validate(cfg, 8)
    with pytest.raises(UserError, match="unknown GLUE task"):
        GLUE_CFG.get_config("task=squad")
    cfg.unlock()
    cfg.train.dropout_rng = "philox"
    with pytest.raises(UserError, match="--config.train.dropout_rng"):
        ft_validate.validate(cfg, 8)
    cfg.train.dropout_rng = "rbg"
    cfg.train.batch_size = 12
    with pytest.raises(UserError, match="train.batch_size"):
        ft_validate.validate(cfg, 8)


def test_all_nine_layouts_parse(env):
    config = make_config(env)
    for task, (n_train, n_dev, n_test) in env["sizes"].items():
        dev = "validation_matched" if task == "mnli" else "validation"
        assert len(data_lib.glue_examples(config, task, "train")) == n_train
        assert len(data_lib.glue_examples(config, task, dev)) == n_dev
        labels = {e["label"] for e in data_lib.glue_examples(config, task, "test")}
        assert labels == {-1}, task
    assert len(data_lib.glue_examples(config, "mnli", "test_mismatched")) == env["sizes"]["mnli"][2] + 1


def test_resolve_init_from_forms(env):
    pre = env["pre"]
    assert ft_init.resolve_init_from(pre) == (pre, None)
    assert ft_init.resolve_init_from(os.path.join(pre, "checkpoints", "10")) == (pre, 10)
    assert ft_init.resolve_init_from(os.path.join(pre, "checkpoints"), 10) == (pre, 10)
    assert ft_init.resolve_init_from(os.path.join(pre, "checkpoints", "10"), 10) == (pre, 10)
    with pytest.raises(UserError, match="init_from names step 10 but init_step is 5, --config.init_step"):
        ft_init.resolve_init_from(os.path.join(pre, "checkpoints", "10"), 5)
    with pytest.raises(UserError, match="nothing does not exist"):
        ft_init.resolve_init_from(str(env["root"] / "nothing"))


def test_params_only_restore_keeps_fresh_head(env, tmp_path):
    config = make_config(env, "mnli")
    runner = ft_runner.Runner(config, str(tmp_path))
    state = runner.init_state()
    saved = env["params"]["encoder"]
    for a, b in zip(jax.tree_util.tree_leaves(state["params"]["encoder"]), jax.tree_util.tree_leaves(saved)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    fresh = jax.jit(lambda r: __import__("flax").linen.meta.unbox(runner.init_fn(r)))(jax.random.PRNGKey(runner.seed))["params"]
    for name in ("pooler", "classifier"):
        for a, b in zip(jax.tree_util.tree_leaves(state["params"][name]), jax.tree_util.tree_leaves(fresh[name])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert state["params"]["classifier"]["kernel"].shape == (TINY["hidden_size"], 3)
    assert not set(state["params"]) & {"head_dense", "head_ln", "head_bias"}
    # the tokenizer is the pretraining run's, copied into the fine-tune workdir
    assert (tmp_path / "tokenizer" / "vocab.txt").read_text() == open(os.path.join(env["pre"], "tokenizer",
                                                                                   "vocab.txt")).read()


def test_segment_embeddings_reach_the_train_and_eval_steps(env, tmp_path):
    """With model.type_vocab_size 2 the fine-tune's loss and eval step read the batch's segments (BERT's token
    types): the same numbers as the model applied with them, not as without."""
    config = make_config(env, "rte", init=False)
    config.model.type_vocab_size = 2
    runner = ft_runner.Runner(config, str(tmp_path))
    params = runner.init_state()["params"]
    params["encoder"]["token_type"]["embedding"] = params["encoder"]["token_type"]["embedding"] * 50
    batch = next(iter(runner.train_batches(0)))
    assert batch.segments.any()
    out = runner.eval_step(params, batch)
    with_segments = runner.model.apply({"params": params}, batch.inputs, batch.input_mask, segments=batch.segments)
    without = runner.model.apply({"params": params}, batch.inputs, batch.input_mask)
    read = np.abs(np.asarray(out["logits"]) - np.asarray(with_segments)).max()
    ignored = np.abs(np.asarray(out["logits"]) - np.asarray(without)).max()
    assert ignored > 100 * read and ignored > 1e-6, (read, ignored)
    loss_fn = ft_runner.make_loss_fn(runner.model)
    key = jax.random.PRNGKey(0)
    loss, _ = loss_fn(params, batch, key)
    params_dropped = jax.tree_util.tree_map(lambda x: x, params)
    params_dropped["encoder"]["token_type"]["embedding"] = params["encoder"]["token_type"]["embedding"].at[1].set(
        params["encoder"]["token_type"]["embedding"][0])
    assert float(loss) != float(loss_fn(params_dropped, batch, key)[0])


@pytest.mark.parametrize("pe,model,needles", [
    ("bert_a", {}, ("'tupe_r'", "'bert_a'")),
    ("tupe_r", {"hidden_size": 64, "mlp_dim": 128}, ("model.hidden_size=32", "model.hidden_size=64")),
    ("tupe_r", {"num_layers": 1}, ("model.num_layers=2", "model.num_layers=1")),
])
def test_refuses_other_scheme_or_size(env, tmp_path, pe, model, needles):
    config = make_config(env, pe=pe)
    config.model.update(model)
    with pytest.raises(UserError) as err:
        ft_loop.finetune(config, str(tmp_path))
    message = str(err.value)
    assert message.startswith("error: ") and "--config.init_from" in message
    for needle in needles:
        assert needle in message


def test_shape_check_without_config_json(env):
    import flax.linen as nn
    from tupe_jax.model import ModelConfig, SequenceClassifier
    meta = ckpt.Checkpointer(env["pre"], read_only=True).restore_meta(10)
    cfg = ModelConfig.from_config(dict(TINY, mlp_dim=96))
    abstract = jax.eval_shape(lambda: SequenceClassifier(cfg, 2).init(jax.random.PRNGKey(0),
                                                                      np.zeros((1, 8), np.int32)))["params"]
    with pytest.raises(UserError, match=r"has shape \[64\] in the checkpoint but \[96\] here"):
        ft_init.check_param_shapes(meta, {"encoder": nn.meta.unbox(abstract["encoder"])})


def test_refuses_missing_checkpoint_and_other_tokenizer(env, tmp_path):
    config = make_config(env)
    config.init_from = str(tmp_path / "missing")
    with pytest.raises(UserError, match="missing does not exist"):
        ft_loop.finetune(config, str(tmp_path / "a"))
    config.init_from, config.init_step = env["pre"], 99
    with pytest.raises(UserError, match="no checkpoint at step 99 in .*, --config.init_step, use one of"):
        ft_loop.finetune(config, str(tmp_path / "b"))
    config.init_step = -1
    workdir_lib.write_config(str(tmp_path / "c"), config)      # a run started there (a leftover alone: the gate's)
    (tmp_path / "c" / "tokenizer").mkdir(parents=True)
    (tmp_path / "c" / "tokenizer" / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nfoo\n")
    with pytest.raises(UserError, match="differs from the tokenizer of init_from's run"):
        ft_loop.finetune(config, str(tmp_path / "c"))
    with pytest.raises(UserError, match="GLUE"):
        bad = make_config(env, "cola")
        bad.data.glue_dir = str(tmp_path / "no_glue")
        ft_loop.finetune(bad, str(tmp_path / "d"))


@pytest.mark.slow
def test_pair_task_beats_majority_and_resumes(env, tmp_path, capsys):
    """Tiny RTE-layout fixture (hypothesis drawn from the premise or not): beats the majority class; an interrupted
    run resumes to the same result; predictions/RTE.tsv has the official name, header, labels and row count."""
    config = make_config(env, "rte", epochs=3, learning_rate=2e-3)
    config.checkpoint.every = 8
    result = ft_loop.finetune(config, str(tmp_path / "a"))
    assert ": 48 steps = 3 epochs x 16 steps, batch 16," in capsys.readouterr().out
    majority = result["majority_baseline"]["accuracy"]
    dev = [e["label"] for e in data_lib.glue_examples(config, "rte", "validation")]
    assert result["score"] > max(majority, scores.majority_accuracy(dev)) + 0.1, result
    assert result["steps"] == 3 * 16 and result["epochs"] == 3
    rows = open(tmp_path / "a" / "predictions" / "RTE.tsv").read().splitlines()
    assert rows[0] == "index\tprediction" and len(rows) == 1 + 40
    assert {r.split("\t")[1] for r in rows[1:]} <= {"entailment", "not_entailment"}
    assert [int(r.split("\t")[0]) for r in rows[1:]] == list(range(40))
    log = [json.loads(line) for line in open(tmp_path / "a" / "metrics.jsonl")]
    assert {"step", "epoch", "loss", "learning_rate"} <= set(log[0])
    assert sum("eval_accuracy" in r for r in log) == 3
    saved = json.load(open(tmp_path / "a" / "results.json"))
    assert saved["best"]["metrics"]["accuracy"] == result["score"]
    # interrupt: drop the last checkpoint and the results, rerun -> resumes at step 32 and ends identically
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "48")
    os.remove(tmp_path / "b" / "results.json")
    again = ft_loop.finetune(config, str(tmp_path / "b"))
    assert again["final"]["metrics"]["accuracy"] == pytest.approx(result["final"]["metrics"]["accuracy"])
    assert again["best"]["step"] == result["best"]["step"]


def test_a_resume_on_changed_glue_files_is_refused_and_changes_nothing(env, tmp_path):
    """The examples' key (the TSVs' contents) is saved with the checkpoints: resuming after dev.tsv changed would
    score the run's best step on one dev set and its last on another."""
    from tests.workdir_fixtures import tree
    glue = tmp_path / "glue"
    shutil.copytree(env["glue"], glue)
    config = make_config(env, "rte", steps=16)
    config.data.glue_dir, config.checkpoint.every = str(glue), 8
    ft_loop.finetune(config, str(tmp_path / "ft"))
    shutil.rmtree(tmp_path / "ft" / "checkpoints" / "16")
    dev = glue / DIRS["rte"] / "dev.tsv"
    dev.write_text("\n".join(dev.read_text().splitlines()[:-1]) + "\n")     # one dev row fewer
    before = tree(str(tmp_path / "ft"))
    with pytest.raises(UserError, match=r"the rte examples differ from those this run started on .*, "
                                        r"--config.data.glue_dir, restore the files"):
        ft_loop.finetune(config, str(tmp_path / "ft"))
    assert tree(str(tmp_path / "ft")) == before


@pytest.mark.slow  # ~15 s on 2 cores with a cold compilation cache, ~5 s warm
@pytest.mark.filterwarnings("ignore:Sharding info not provided")   # the final checkpoint, read without a target
def test_wordorder_finetune_machinery(env, tmp_path, monkeypatch, capsys):
    """The built-in word-order task through the fine-tuning loop from a pretraining run: the encoder the run starts from
    is the pretraining checkpoint's (not a fresh init), training moves it, and results.json / metrics.jsonl hold a
    valid accuracy on the balanced dev set. Whether the model beats chance is an experiment (see the GLUE notes),
    not a test: with a tiny, briefly pretrained model it depends on the seed."""
    import flax.linen as nn
    from tupe_jax import metrics as metrics_lib
    from tupe_jax import trainer as trainer_lib

    config = make_config(env, "wordorder", steps=3, batch_size=16, eval_batch_size=64, log_every=1,
                         predict_test=False)
    config.checkpoint.every = 100000
    train = [e["label"] for e in data_lib.glue_examples(config, "wordorder", "train")]
    dev = [e["label"] for e in data_lib.glue_examples(config, "wordorder", "validation")]
    for labels in (train, dev):  # every sentence twice: as is (1) and locally shuffled (0)
        assert len(labels) >= 100 and labels == [1, 0] * (len(labels) // 2)

    seen = {}
    restore_or_init = trainer_lib.Trainer.restore_or_init

    def spy(trainer, *args, **kwargs):  # record the state the loop starts from, and what a fresh init would be
        state, payload = restore_or_init(trainer, *args, **kwargs)
        seen["step"], seen["payload"] = int(state["step"]), payload
        seen["start"] = jax.tree_util.tree_map(np.array, state["params"])
        fresh = jax.jit(lambda r: nn.meta.unbox(trainer.init_fn(r)))(trainer.rng)["params"]
        seen["fresh"] = jax.tree_util.tree_map(np.array, fresh)
        return state, payload

    monkeypatch.setattr(trainer_lib.Trainer, "restore_or_init", spy)
    workdir = tmp_path / "ft"
    result = ft_loop.finetune(config, str(workdir), devices=jax.devices()[:1])
    spe = len(train) // 16
    assert f": 3 steps (train.steps; {3 / spe:.3g} epochs of {spe} steps), batch 16," in capsys.readouterr().out

    # step 0 (a new workdir: nothing restored from it): encoder == the pretraining checkpoint (step 10), leaf by
    # leaf, bitwise; and that is not what a fresh init gives
    assert seen["step"] == 0 and seen["payload"] is None
    saved = jax.tree_util.tree_leaves_with_path(env["params"]["encoder"])
    start = jax.tree_util.tree_leaves_with_path(seen["start"]["encoder"])
    assert [p for p, _ in start] == [p for p, _ in saved] and len(saved) > 10
    for (path, a), (_, b) in zip(start, saved):
        np.testing.assert_array_equal(a, np.asarray(b), err_msg=jax.tree_util.keystr(path))
    fresh = jax.tree_util.tree_leaves(seen["fresh"]["encoder"])
    random = [(a, b) for (_, a), b in zip(start, fresh) if np.ptp(b) > 0]  # not the constant 0 / 1 inits
    assert len(random) >= 10 and all(not np.array_equal(a, b) for a, b in random)
    # ... while the new head is the fresh one
    for name in ("pooler", "classifier"):
        for a, b in zip(jax.tree_util.tree_leaves(seen["start"][name]), jax.tree_util.tree_leaves(seen["fresh"][name])):
            np.testing.assert_array_equal(a, b)
    # the run trained: the final checkpoint's encoder moved away from the restored one
    final = ckpt.restore_params(str(workdir))
    moved = [not np.allclose(np.asarray(a), b) for a, (_, b) in zip(jax.tree_util.tree_leaves(final["encoder"]),
                                                                      start)]
    assert sum(moved) >= len(moved) // 2

    saved_results = json.load(open(workdir / "results.json"))
    assert saved_results == json.loads(json.dumps(result, default=float))
    assert result["task"] == "wordorder" and result["headline_key"] == "accuracy"
    assert result["steps"] == 3 and result["batch_size"] == 16
    assert result["init_from"] == env["pre"] and result["init_step"] == 10
    assert result["majority_baseline"] == {"accuracy": 0.5}
    n = len(dev)
    for value in (result["score"], result["final"]["metrics"]["accuracy"]):
        assert 0.0 <= value <= 1.0 and abs(value * n - round(value * n)) < 1e-6  # k correct of n dev examples
    assert result["best"]["step"] == result["final"]["step"] == 3
    rows = metrics_lib.read_metrics(str(workdir))
    losses = [r for r in rows if "loss" in r]
    assert [r["step"] for r in losses] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in losses)
    assert [r.get("eval_accuracy") for r in rows if "eval_accuracy" in r] == [result["score"]]


@pytest.mark.slow
def test_submission_files_for_every_task(env, tmp_path):
    """Each task's official file(s) with the right rows, from the restored (untrained) model of a Runner."""
    for task in DIRS:
        runner = ft_runner.Runner(make_config(env, task, batch_size=8, eval_batch_size=8), str(tmp_path / task))
        runner.write_test_predictions(runner.init_state()["params"])
    files = {}
    for task in DIRS:
        for name in os.listdir(tmp_path / task / "predictions"):
            files[name] = open(tmp_path / task / "predictions" / name).read().splitlines()
    assert sorted(files) == sorted(f"{n}.tsv" for n in ("CoLA", "SST-2", "MRPC", "STS-B", "QQP", "MNLI-m", "MNLI-mm",
                                                          "QNLI", "RTE", "WNLI", "AX"))
    assert all(rows[0] == "index\tprediction" for rows in files.values())
    n_test = {n: env["sizes"][t][2] for t, n in (("cola", "CoLA"), ("sst2", "SST-2"), ("mrpc", "MRPC"),
                                                  ("stsb", "STS-B"), ("qqp", "QQP"), ("qnli", "QNLI"),
                                                  ("rte", "RTE"), ("wnli", "WNLI"), ("mnli", "MNLI-m"))}
    n_test.update({"MNLI-mm": env["sizes"]["mnli"][2] + 1, "AX": 7})
    for name, n in n_test.items():
        assert len(files[f"{name}.tsv"]) == 1 + n, name
    float(files["STS-B.tsv"][1].split("\t")[1])
    assert files["MNLI-m.tsv"][1].split("\t")[1] in {"entailment", "neutral", "contradiction"}
    assert files["CoLA.tsv"][1].split("\t")[1] in {"0", "1"}


@pytest.mark.slow
def test_sweep_skips_finished_runs_and_writes_tables(env, tmp_path):
    config = make_config(env, "rte", steps=2)
    config.sweep.learning_rates, config.sweep.seeds = (1e-3, 2e-3), (0, 1)
    config.train.predict_test = False
    summary = ft_sweep.sweep(config, str(tmp_path))
    assert sorted(os.listdir(tmp_path / "rte")) == ["lr=0.001", "lr=0.002"]
    assert summary["tasks"]["rte"]["best_lr"] in ("0.001", "0.002") and "RTE" in summary["reported"]
    assert (tmp_path / "sweep.md").read_text().startswith("# GLUE sweep")
    assert json.load(open(tmp_path / "sweep.json"))["glue_average_columns"] == ["RTE"]
    stamp = os.path.getmtime(tmp_path / "rte" / "lr=0.001" / "seed=0" / "results.json")
    ft_sweep.sweep(config, str(tmp_path))   # everything finished: only the tables are rewritten
    assert os.path.getmtime(tmp_path / "rte" / "lr=0.001" / "seed=0" / "results.json") == stamp
