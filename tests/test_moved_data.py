"""A run resumes from a copy of its text at another path (a relaunched VM whose disk mounts elsewhere, a folder
moved): `data.path` and `data.glue_dir` may change on resume, and the text itself is held to the run's by the keys
its checkpoints keep (the data iterator's, the GLUE examples'). Both were refused as "a run with data.path=...",
though the copy was the same text."""
import hashlib
import json
import re
import shutil

import pytest

import launch
from tests.glue_fixtures import glue_env, make_config
from tests.test_data_prepare import write_corpus
from tests.workdir_fixtures import tree
from tupe_jax.errors import UserError
from tupe_jax.finetune import loop as ft_loop

PRETRAIN = ["pretrain", "--config=configs/pretrain.py:pe=bert_a,size=tiny", "--config.model.max_len=32",
            "--config.model.vocab_size=200", "--config.train.batch_size=8", "--config.train.eval_every=0",
            "--config.checkpoint.every=3", "--config.checkpoint.async_save=false", "--config.data.name=text_files",
            "--config.train.decay_steps=9", "--config.train.log_every=1"]


def hashed_then(config: dict) -> str:
    """The identity session 40's meta.identity_hash gave: data.path and data.glue_dir were not resumable then."""
    from tupe_jax import config as config_lib
    from tupe_jax.workdir import meta
    flat = config_lib.flatten({s: config[s] for s in ("model", "data")})
    kept = {k: v for k, v in flat.items() if not (meta.resumable(k) and k not in ("data.path", "data.glue_dir"))
            and not (k in meta.ADDED_DEFAULTS and v == meta.ADDED_DEFAULTS[k])}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def losses(run):
    return [(r["step"], r["loss"]) for r in map(json.loads, open(run / "metrics.jsonl")) if "loss" in r]


def test_a_pretraining_run_resumes_from_a_copy_of_its_corpus_elsewhere(tmp_path, capsys):
    corpus, cache = write_corpus(tmp_path / "corpus"), f"--config.data.cache_dir={tmp_path / 'cache'}"
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    assert launch.main([*PRETRAIN, f"--workdir={straight}", f"--config.data.path={corpus}", cache,
                        "--config.train.steps=6"]) == 0
    assert launch.main([*PRETRAIN, f"--workdir={moved}", f"--config.data.path={corpus}", cache,
                        "--config.train.steps=3"]) == 0
    copy = shutil.copytree(corpus, tmp_path / "elsewhere" / "corpus")
    shutil.rmtree(corpus)
    assert launch.main([*PRETRAIN, f"--workdir={moved}", f"--config.data.path={copy}", cache,
                        "--config.train.steps=6"]) == 0
    assert losses(moved) == losses(straight)
    assert "data.path" in capsys.readouterr().out                     # the change is said, and recorded
    assert json.loads((moved / "config.json").read_text())["data"]["path"] == str(copy)
    other = shutil.copytree(copy, tmp_path / "other")
    (other / "train.txt").write_text((other / "train.txt").read_text().replace("a", "b"))
    before, streams = tree(str(moved)), sorted((tmp_path / "cache").rglob("*.tokens.npy"))
    for steps in (9, 6):             # to train on, and finished (its config.json took any data.path unchecked)
        assert launch.main([*PRETRAIN, f"--workdir={moved}", f"--config.data.path={other}", cache,
                            f"--config.train.steps={steps}"]) == 2
        assert "error: the text read is not the one this run trained on (its content key differs from the one its " \
            f"checkpoint's data-iterator state saved), data.path={other}, point data.path" in capsys.readouterr().err
        assert tree(str(moved)) == before                            # config.json still names the copy
        assert sorted((tmp_path / "cache").rglob("*.tokens.npy")) == streams    # refused before tokenizing it


def test_a_fine_tune_resumes_from_a_copy_of_its_glue_folder_elsewhere(tmp_path, capsys):
    env = glue_env(tmp_path / "env")
    config = make_config(env, "rte", steps=16)
    config.checkpoint.every = 8
    straight = ft_loop.finetune(config, str(tmp_path / "straight"))
    ft_loop.finetune(config, str(tmp_path / "ft"))
    shutil.rmtree(tmp_path / "ft" / "checkpoints" / "16")          # stopped after its step-8 checkpoint
    (tmp_path / "ft" / "results.json").unlink()
    config.data.glue_dir = str(shutil.copytree(env["glue"], tmp_path / "elsewhere"))
    again = ft_loop.finetune(config, str(tmp_path / "ft"))
    assert "resumed rte from step 8" in capsys.readouterr().out
    assert again["final"]["metrics"] == straight["final"]["metrics"]
    edited = shutil.copytree(env["glue"], tmp_path / "edited")   # one dev label swapped: other examples
    dev = next(edited.rglob("RTE/dev.tsv"))
    rows = dev.read_text().splitlines()
    rows[1] = rows[1].replace("not_entailment", "entailment") if "not_entailment" in rows[1] else \
        rows[1].replace("entailment", "not_entailment")
    dev.write_text("\n".join(rows) + "\n")
    config.data.glue_dir = str(edited)
    before = tree(str(tmp_path / "ft"))
    with pytest.raises(UserError, match="the rte examples differ from those this run started on"):
        ft_loop.finetune(config, str(tmp_path / "ft"))              # finished, yet not on other examples
    assert tree(str(tmp_path / "ft")) == before


def test_a_checkpoint_that_hashed_the_paths_still_resumes_from_its_folder_or_a_copy():
    """Checkpoints made before session 41 keep an identity hash over every model/data key but the resumable ones
    of then, data.path and data.glue_dir included; they resume, from the old path and from a moved one."""
    from tests.glue_fixtures import load_config_module
    from tupe_jax.workdir import meta

    config = load_config_module("pretrain").get_config("pe=bert_a,size=tiny")
    config.data.name, config.data.path = "text_files", "/data/a"
    stored = hashed_then(config.to_dict())
    moved = config.copy_and_resolve_references()
    moved.data.path = "/mnt/b"
    then = [{"data.path": "/data/a", "data.glue_dir": ""}]          # what the run had (gate.paths_then)
    assert meta.same_identity(stored, config) and meta.same_identity(stored, moved, then)
    assert not meta.same_identity(stored, moved)                     # the path it had is needed to tell
    other = moved.copy_and_resolve_references()
    other.data.split_by = "file"
    assert not meta.same_identity(stored, other, then)
    assert meta.same_identity(meta.identity_hash(config), moved)     # made now: the paths are not in it



def test_a_checkpoint_that_hashed_an_older_path_resumes_after_config_json_moved_on(tmp_path, capsys):
    """A run of before session 41, moved, and killed before its next checkpoint: config.json names the new path
    while the newest checkpoint hashed the old one, which config_history.jsonl records."""
    from tupe_jax.workdir import meta
    corpus, cache = write_corpus(tmp_path / "corpus"), f"--config.data.cache_dir={tmp_path / 'cache'}"
    run = tmp_path / "run"
    assert launch.main([*PRETRAIN, f"--workdir={run}", f"--config.data.path={corpus}", cache,
                        "--config.train.steps=3"]) == 0
    config = json.loads((run / "config.json").read_text())
    then = hashed_then(config)
    now = meta.identity_hash(config)
    (saved,) = [p for p in (run / "checkpoints" / "3").rglob("*") if p.is_file() and now.encode() in p.read_bytes()]
    saved.write_bytes(saved.read_bytes().replace(now.encode(), then.encode()))   # as session 40 saved it
    copy = shutil.copytree(corpus, tmp_path / "copy")
    config["data"]["path"] = str(copy)                     # the moved resume's gate wrote these, then it was killed
    (run / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (run / "config_history.jsonl").write_text(json.dumps({"changes": {"data.path": [str(corpus), str(copy)]}}) + "\n")
    assert launch.main([*PRETRAIN, f"--workdir={run}", f"--config.data.path={copy}", cache,
                        "--config.train.steps=6"]) == 0
    assert [s for s, _ in losses(run)] == [1, 2, 3, 4, 5, 6]


def test_the_paths_a_run_had_are_read_from_its_history(tmp_path):
    """Each older value config_history.jsonl records is tried, and a row that moved both paths as one pair."""
    from tupe_jax.workdir import gate
    (tmp_path / "config_history.jsonl").write_text(
        json.dumps({"changes": {"data.path": ["/a", "/b"]}}) + "\n" + "torn {\n"
        + json.dumps({"changes": {"data.path": ["/b", "/c"], "data.glue_dir": ["/g", "/h"], "train.steps": [3, 6]}})
        + "\n")
    then = gate.paths_then(str(tmp_path), {"data.path": "/c", "data.glue_dir": "/h", "train.steps": 6})
    assert {"data.path": "/a", "data.glue_dir": "/h"} in then and {"data.path": "/b", "data.glue_dir": "/g"} in then
    assert then[0] == {"data.path": "/c", "data.glue_dir": "/h"}


def test_a_tfds_dataset_resumes_from_a_copy_in_another_folder(tmp_path):
    """`data.tfds_data_dir` is resumable: the iterator state holds a TFDS dataset by its full name, text feature and
    split sizes (its info), no longer by its folder; a state keyed by the folder, as before, resumes from there."""
    import ml_collections
    from tupe_jax import data as D
    from tupe_jax.data import builders
    folder = tmp_path / "corpus"
    folder.mkdir()
    for split in ("train", "valid"):
        (folder / f"{split}.txt").write_text("\n\n".join(f"document {i} has words and more words {i * 7}"
                                                         for i in range(200)))

    def config(**data):
        c = ml_collections.ConfigDict({"data": D.default_data_config(),
                                       "model": {"vocab_size": 300, "max_len": 32, "objective": "mlm"}})
        c.data.update(dict(cache_dir=str(tmp_path / "cache"), prefetch=0, holdout=0, **data))
        return c

    raw = config(name="text_files", path=str(folder))
    built = builders.corpus_builder(raw)            # a dataset under <cache>/tfds, read back by its name
    name = f"tfds:{built.name}/{built.builder_config.name}"
    here = config(name=name, tfds_data_dir=str(tmp_path / "cache" / "tfds"))
    tok = D.get_tokenizer(raw, tmp_path / "run")

    def it(c):
        return D.pretrain_iterator(c, tok, split="train", global_batch_size=8, seed=7, process_index=0,
                                   process_count=1)

    def same(batch, other):
        return batch.keys() == other.keys() and all((batch[k] == v).all() for k, v in other.items())
    first = it(here)
    next(first)
    state = json.loads(json.dumps(first.get_state()))
    expected = next(first).present()
    moved_dir = shutil.copytree(tmp_path / "cache" / "tfds", tmp_path / "elsewhere" / "tfds")
    moved = it(config(name=name, tfds_data_dir=str(moved_dir)))
    moved.set_state(state)
    assert same(next(moved).present(), expected)
    (info,) = moved_dir.rglob("dataset_info.json")             # another dataset of that name: its sizes differ
    record = json.loads(info.read_text())
    record["splits"][0]["numBytes"] = str(int(record["splits"][0]["numBytes"]) + 1)
    info.write_text(json.dumps(record))
    with pytest.raises(UserError, match=rf"^error: the text read is not the one this run trained on .*, "
                                        rf"data.name={re.escape(name)}, resume with the corpus"):
        it(config(name=name, tfds_data_dir=str(moved_dir))).set_state(state)
    folder_key = builders.corpus_fingerprint(here, "train")[0]           # as a state saved before this keyed it
    old = {**state, "fingerprint": builders.digest([folder_key, "train", tok.fingerprint, "mlm", 32, 8, 1, 7, True,
                                                    True, 0.15, 5, "full_sentences"])}
    del old["corpus"]
    again = it(here)
    again.set_state(old)
    assert same(next(again).present(), expected)
