"""The analyses of a run trained on a `launch prepare`d directory: they read the split's token stream back from its
records (they failed with "unknown data.name 'prepared'"). The stream equals the raw corpus tokenized by the
pipeline with the same vocabulary, for both packings of records (MLM blocks, CLM windows that share a token)."""
import json

import ml_collections
import numpy as np
import pytest

import launch
from tests.test_data_prepare import prepare_args, run_config, write_corpus
from tupe_jax import data as D
from tupe_jax.data import pipeline


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.mark.parametrize("objective", ["mlm", "clm"])
def test_the_stream_read_back_is_the_corpus_tokenized(corpus, tmp_path, objective):
    out = tmp_path / "prepared"
    assert launch.main(prepare_args(corpus, out, objective=objective)) == 0
    config = run_config(out, objective)
    config.data.cache_dir = str(tmp_path / "cache")
    raw = ml_collections.ConfigDict({"data": {**D.default_data_config().to_dict(), "name": "text_files",
                                              "path": str(corpus), "cache_dir": str(tmp_path / "raw")}})
    tok = D.Tokenizer.from_file(out / "tokenizer" / "vocab.txt")
    for split in ("train", "validation"):
        want, _ = pipeline.token_stream(raw, tok, split)
        got = D.token_stream(config, tok, split)
        assert len(got) > 10 * 32 and got.dtype == np.int32
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=split)
        assert np.array_equal(D.token_stream(config, tok, split), got)    # the cached copy


def test_the_analyses_read_a_prepared_run(corpus, tmp_path, capsys):
    out, run = tmp_path / "prepared", tmp_path / "run"
    assert launch.main(prepare_args(corpus, out, objective="clm")) == 0
    assert launch.main(["pretrain", "--config=configs/pretrain.py:pe=alibi,objective=clm", f"--workdir={run}",
                        "--config.data.name=prepared", f"--config.data.path={out}",
                        f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.model.max_len=32",
                        "--config.model.vocab_size=200", "--config.model.num_layers=1", "--config.train.steps=2",
                        "--config.train.batch_size=8", "--config.checkpoint.async_save=False"]) == 0
    assert launch.main(["extrapolate", f"--workdir={run}", "--lengths=16,64", f"--out={tmp_path / 'ex'}"]) == 0
    assert launch.main(["probe", f"--workdir={run}", "--probe_steps=3", f"--out={tmp_path / 'probe'}"]) == 0
    assert launch.main(["correlations", f"--workdir={run}", f"--out={tmp_path / 'corr'}"]) == 0
    capsys.readouterr()
    ex = json.loads(next((tmp_path / "ex").glob("*.json")).read_text())
    results = ex["runs"][0]["results"]
    assert [r["length"] for r in results] == [16, 64] and all(r["perplexity"] > 1 for r in results)
