"""Analysis tools (issue #6): extrapolation windows and numbers, position probes, logit decomposition, shuffles.

Runs are built in memory (tiny ModelConfig + perturbed init params + the embedded corpus in a tmp cache), so
these tests need no trained workdir; tests/test_analysis_e2e.py drives the launcher on real tiny pretraining runs.
"""
import json
import math
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import launch
from tupe_jax import data as D
from tupe_jax.analysis import common, correlations as C, extrapolate as E, probe as P, shuffle as S
from tupe_jax.attention import attention_mask
from tupe_jax.errors import UserError
from tupe_jax.model import ModelConfig, TransformerLM, init_params

MAX_LEN = 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("analysis")
    config = ml_collections.ConfigDict({"data": D.default_data_config(),
                                        "model": {"vocab_size": 512, "max_len": MAX_LEN, "objective": "clm"}})
    config.data.cache_dir = str(tmp / "cache")
    config.data.prefetch = 0
    return config, D.get_tokenizer(config, None)


def make_run(corpus, pe, objective, noise=0.05, seed=0, **model):
    """A tiny model with every parameter perturbed (so LN gains/biases and q/k biases are non-trivial)."""
    config, tok = corpus
    config = config.copy_and_resolve_references()
    config.model.objective = objective
    cfg = ModelConfig(vocab_size=512, hidden_size=32, num_layers=2, num_heads=2, mlp_dim=64, max_len=MAX_LEN, pe=pe,
                      objective=objective, untie_cls=objective == "mlm", **model)
    params = init_params(cfg, jax.random.PRNGKey(seed))
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    params = jax.tree_util.tree_unflatten(
        tree, [x + noise * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    return common.Run(config, cfg, params, tok, 0, f"/runs/{pe}-{objective}")


# ----------------------------------------------------------------------------------------------- extrapolate

@pytest.mark.parametrize("n,length,mode,stride", [(100, 16, "nonoverlapping", None), (100, 16, "sliding", 5),
                                                  (17, 16, "nonoverlapping", None), (10, 16, "sliding", 3),
                                                  (64, 8, "sliding", 1), (64, 8, "sliding", 50)])
def test_windows_score_every_token_once_with_context(n, length, mode, stride):
    begin, lo, hi = E.clm_windows(n, length, mode, stride)
    stream = np.arange(n, dtype=np.int32)
    batch = E.clm_batch(stream, begin, lo, hi, length)
    scored = batch.targets[batch.weights > 0]
    np.testing.assert_array_equal(np.sort(scored), np.arange(1, n))           # each target exactly once
    # inputs are the stream shifted by one: target t is predicted from input t-1 of the same window
    rows, cols = np.nonzero(batch.weights)
    np.testing.assert_array_equal(batch.inputs[rows, cols] + 1, batch.targets[rows, cols])
    if mode == "sliding" and stride < length:
        later = rows > 0
        assert (cols[later] >= length - stride).all()                        # ≥ L−S tokens of context


def test_extrapolation_at_train_length_matches_the_pipeline(corpus, capsys):
    run = make_run(corpus, "rope", "clm")
    ours = E.evaluate_length(run, MAX_LEN)
    config = run.config
    it = D.pretrain_iterator(config, run.tokenizer, split="validation", global_batch_size=16, seed=0,
                             process_index=0, process_count=1, shuffle=False, repeat=False)
    model = TransformerLM(run.model_cfg)
    forward = jax.jit(lambda p, x: jax.nn.log_softmax(model.apply({"params": p}, x)["logits"]))
    total = count = 0.0
    for b in it:
        logp = forward(run.params, jnp.asarray(b.inputs))
        nll = -np.take_along_axis(np.asarray(logp), b.targets[..., None], -1)[..., 0]
        total += float((nll * b.weights).sum())
        count += float(b.weights.sum())
    assert ours["tokens"] == count
    assert ours["nll"] == pytest.approx(total / count, rel=1e-5)
    assert ours["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    sliding = E.evaluate_length(run, MAX_LEN, mode="sliding", stride=MAX_LEN)   # S = L is nonoverlapping
    assert sliding["nll"] == pytest.approx(ours["nll"], rel=1e-6) and sliding["tokens"] == ours["tokens"]
    capsys.readouterr()
    capped = E.evaluate_length(run, MAX_LEN, mode="sliding", stride=3 * MAX_LEN)  # S > L: capped at L, said aloud
    assert capped["stride"] == MAX_LEN and capped["nll"] == sliding["nll"]
    assert f"stride {3 * MAX_LEN} is capped at L" in capsys.readouterr().out


@pytest.mark.slow
def test_extrapolation_finite_past_train_length_and_undefined_for_tables(corpus, tmp_path):
    runs = [make_run(corpus, pe, "clm") for pe in ("rope", "alibi", "nopos", "sinusoidal", "bert_a")]
    runs.append(make_run(corpus, "alibi", "mlm"))
    lengths = [MAX_LEN, 4 * MAX_LEN]
    report = E.run("/unused", lengths, out=str(tmp_path), runs=runs, max_tokens=2000, token_budget=256)
    by = {(r["pe"], r["objective"]): r for r in report["runs"]}
    for pe in ("rope", "alibi", "nopos", "sinusoidal"):
        res = by[(pe, "clm")]["results"]
        assert all(x["defined"] and math.isfinite(x["perplexity"]) and 1 < x["perplexity"] for x in res), res
        assert res[-1]["batch_rows"] == 2                                    # 256-token budget / 128
    mlm = by[("alibi", "mlm")]["results"]
    assert all(x["defined"] and math.isfinite(x["mlm_loss"]) for x in mlm)
    table = by[("bert_a", "clm")]["results"]
    assert [x["defined"] for x in table] == [True, False]
    assert "not defined beyond max_len=32" in table[1]["reason"] and "perplexity" not in table[1]
    saved = json.loads((tmp_path / "extrapolation.json").read_text())
    assert saved["protocol"]["mode"] == "nonoverlapping" and len(saved["runs"]) == 6
    assert (tmp_path / "extrapolation.png").stat().st_size > 1000
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


def test_extrapolation_rejects_bad_modes(corpus):
    mlm = make_run(corpus, "alibi", "mlm")
    with pytest.raises(UserError, match="causal LMs only"):
        E.evaluate_length(mlm, 16, mode="sliding", stride=4)
    with pytest.raises(UserError, match="unknown extrapolation mode"):
        E.extrapolate([mlm], [16], mode="strided")


def test_a_length_the_text_cannot_fill_is_refused_before_any_compute(corpus, tmp_path, monkeypatch):
    """Windows were cut to the stream's end: past the text's length every L gave the same number, labelled L."""
    runs = [make_run(corpus, "alibi", "clm"), make_run(corpus, "alibi", "mlm")]
    monkeypatch.setattr(E, "evaluate_length", lambda *a, **k: pytest.fail("computed before the check"))
    with pytest.raises(UserError, match=r"^error: the validation text of .* has 40 tokens \(max_tokens 40\), fewer "
                                        r"than one window of length 40 needs \(41\), --lengths, .*raise max_tokens"):
        E.run("/unused", [16, 40, 64], out=str(tmp_path), runs=runs[:1], max_tokens=40)
    with pytest.raises(UserError, match=r"has 40 tokens \(max_tokens 40\), fewer than one window of length 64 "
                                        r"needs \(63\)"):
        E.run("/unused", [16, 40, 64], out=str(tmp_path), runs=runs[1:], max_tokens=40)
    assert os.listdir(tmp_path) == []


def test_runs_scored_on_other_tokens_or_given_twice_are_refused(corpus, tmp_path, monkeypatch):
    """Runs with vocabularies of 512 and 256 were set side by side (435.6 beside 221.6); one workdir given twice
    appeared twice, and two runs of one folder name wrote one PNG."""
    from tupe_jax.workdir import run as run_lib  # pylint: disable=import-outside-toplevel
    runs = [make_run(corpus, "alibi", "clm"), make_run(corpus, "rope", "clm")]
    other = {id(runs[1]): np.arange(5000, dtype=np.int32) % 300}         # rope's text: other tokens
    real = common.token_stream
    monkeypatch.setattr(common, "token_stream", lambda run, split: other.get(id(run), real(run, split)))
    monkeypatch.setattr(E, "evaluate_length", lambda *a, **k: pytest.fail("computed before the check"))
    with pytest.raises(UserError, match=r"score different validation tokens \(another corpus or tokenizer\)"):
        E.extrapolate(runs, [16])
    (tmp_path / "a" / "run").mkdir(parents=True)
    (tmp_path / "b" / "run").mkdir(parents=True)
    monkeypatch.setattr(run_lib, "load_run", lambda *a: pytest.fail("loaded before the check"))
    with pytest.raises(UserError, match=r"^error: --workdir .*/a/run/ is given twice: "):
        run_lib.load_runs([str(tmp_path / "a" / "run"), str(tmp_path / "a" / "run") + "/"])
    with pytest.raises(UserError, match=r"has the folder name of .*/a/run: .*analyse runs of one folder name in sep"):
        run_lib.load_runs([str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run")])


# ------------------------------------------------------------------------------------------------------ probe

def test_chance_level():
    assert P.chance_mad(1024) == pytest.approx(341.33, abs=0.01)
    n = 7
    assert P.chance_mad(n) == pytest.approx(np.abs(np.arange(n)[:, None] - np.arange(n)[None]).mean())


def test_probe_exact_positions_vs_random_states():
    n, d = 32, 32
    rng = np.random.default_rng(0)

    def states(tokens):
        y = np.tile(np.arange(n), tokens // n)
        angles = np.arange(n)[:, None] / 100.0 ** (np.arange(d // 2)[None] * 2.0 / d)
        table = np.concatenate([np.sin(angles), np.cos(angles)], 1)
        exact = table[y] + 0.01 * rng.normal(size=(len(y), d))
        return np.stack([exact, rng.normal(size=(len(y), d))]).astype(np.float32), y

    tx, ty = states(4096)
    ex, ey = states(2048)
    layers = P.train_probes(tx, ty, ex, ey, n, P.ProbeSettings(steps=300))
    assert layers[0]["mad"] < 0.1 and layers[0]["accuracy"] > 0.95
    assert layers[1]["mad"] == pytest.approx(P.chance_mad(n), rel=0.15)
    assert layers[1]["accuracy"] < 0.1


def test_a_probe_fit_in_chunks_is_the_fit_in_one_program(monkeypatch):
    """The fit runs FIT_CHUNK Adam steps per call (so Ctrl-C can stop it between calls): the probes are those of one
    scan over every step, a last shorter chunk included."""
    rng = np.random.default_rng(1)
    tx, ex = rng.normal(size=(2, 512, 16)).astype(np.float32), rng.normal(size=(2, 256, 16)).astype(np.float32)
    ty, ey = np.tile(np.arange(8), 64), np.tile(np.arange(8), 32)
    settings = P.ProbeSettings(steps=37, batch_tokens=64)
    assert P.FIT_CHUNK < 37 and 37 % P.FIT_CHUNK
    chunked = P.train_probes(tx, ty, ex, ey, 8, settings)
    monkeypatch.setattr(P, "FIT_CHUNK", 1000)
    whole = P.train_probes(tx, ty, ex, ey, 8, settings)
    for a, b in zip(chunked, whole):
        assert a["mad"] == b["mad"] and a["accuracy"] == b["accuracy"]
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6, abs=0)


def test_probe_run_outputs(corpus, tmp_path):
    runs = [make_run(corpus, "sinusoidal", "clm"), make_run(corpus, "nopos", "mlm")]
    settings = P.ProbeSettings(steps=60, train_tokens=1024, eval_tokens=512)
    report = P.run("/unused", out=str(tmp_path), settings=settings, runs=runs)
    for r in report["runs"]:
        n = 32 - r["first_position"]                # MLM: [CLS] at position 0 is left out
        assert [x["layer"] for x in r["layers"]] == [0, 1, 2] and r["chance_mad"] == pytest.approx(P.chance_mad(n))
    nopos = report["runs"][1]["layers"][0]   # a position-free bidirectional embedding: no position information
    assert nopos["mad"] > 0.6 * P.chance_mad(31)
    assert json.loads((tmp_path / "probe.json").read_text())["settings"]["steps"] == 60
    assert (tmp_path / "probe.png").stat().st_size > 1000


# ----------------------------------------------------------------------------------------------- correlations

@pytest.mark.parametrize("pe,objective,kind,layer", [
    ("bert_a", "mlm", "additive", 0), ("bert_a", "clm", "additive", 0), ("bert_r", "mlm", "additive", 0),
    ("tupe_r", "mlm", "untied", 1), ("bert_ad", "clm", "disentangled", 1), ("alibi", "clm", "other", 0)])
def test_decomposition_adds_up_to_the_model_logits(corpus, pe, objective, kind, layer):
    run = make_run(corpus, pe, objective, noise=0.2)
    tokens = common.model_windows(run, "validation", MAX_LEN, count=3)
    dec = C.decompose(run, tokens, layer)
    assert dec["kind"] == kind
    if kind in ("additive", "disentangled"):
        assert list(dec["terms"]) == list(C.FOUR)
    total = sum(dec["terms"].values())
    real = C.model_logits(run, tokens, layer)
    np.testing.assert_allclose(total, real, atol=1e-5, rtol=0)
    # and those logits are the ones the model softmaxes: compare with its returned attention probabilities
    mask = np.asarray(attention_mask(None, MAX_LEN, run.model_cfg.causal) if run.model_cfg.causal else True)
    logits = np.where(mask, total, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(probs, common.attention_probs(run, tokens)[layer], atol=1e-5)


def test_the_additive_split_of_a_model_with_segment_embeddings_adds_up(corpus):
    """An imported BERT adds segment 0's row to every token: the split left it out (off by ~2 logits there)."""
    run = make_run(corpus, "bert_a", "mlm", noise=0.2, type_vocab_size=2)
    tokens = common.model_windows(run, "validation", MAX_LEN, count=2)
    total = sum(C.decompose(run, tokens, 0)["terms"].values())
    np.testing.assert_allclose(total, C.model_logits(run, tokens, 0), atol=1e-5, rtol=0)


def test_additive_split_puts_everything_in_word_word_without_positions(corpus):
    run = make_run(corpus, "bert_a", "mlm", noise=0.2)
    run.params = jax.tree_util.tree_map(lambda x: x, run.params)
    run.params["encoder"]["positional"]["table"] = jnp.zeros_like(run.params["encoder"]["positional"]["table"])
    tokens = common.model_windows(run, "validation", MAX_LEN, count=2)
    terms = C.decompose(run, tokens, 0)["terms"]
    for name in ("word-position", "position-word", "position-position"):
        assert np.abs(terms[name]).max() < 1e-12
    assert np.abs(terms["word-word"]).max() > 1e-3


def test_correlations_report_and_tupe_figure(corpus, tmp_path):
    runs = [make_run(corpus, "tupe_a", "mlm", noise=0.2), make_run(corpus, "bert_a", "mlm", noise=0.2)]
    report = C.run("/unused", out=str(tmp_path), runs=runs, batch=4)
    tupe, bert = report["runs"]
    assert tupe["kind"] == "untied" and tupe["max_abs_error_vs_model"] < 1e-5
    # the untied position term is input-independent: all of its variance is (head, i, j) structure
    assert tupe["terms"]["position"]["structured_fraction"] == pytest.approx(1.0, abs=1e-9)
    assert tupe["terms"]["word"]["structured_fraction"] < 0.9
    assert set(bert["terms"]) == set(C.FOUR) and bert["terms"]["word-word"]["variance_vs_word"] == 1.0
    names = set(os.listdir(tmp_path))
    assert {"correlations.json", "correlations_tupe_a-mlm.png", "correlations_bert_a-mlm.png",
            "positional_correlation_tupe_a-mlm.png"} <= names
    first = (tmp_path / "correlations.json").read_bytes()
    C.run("/unused", out=str(tmp_path), runs=runs, batch=4, layer=1)   # another layer keeps the first's files
    assert (tmp_path / "correlations.json").read_bytes() == first
    assert json.loads((tmp_path / "correlations_layer1.json").read_text())["runs"][0]["layer"] == 1
    assert {"correlations_tupe_a-mlm_layer1.png", "positional_correlation_tupe_a-mlm_layer1.png"} <= set(
        os.listdir(tmp_path))
    corr = C.positional_correlation(runs[0], MAX_LEN)
    assert corr.shape == (2, MAX_LEN, MAX_LEN)
    with pytest.raises(UserError, match="out of range"):
        C.decompose(runs[1], np.zeros((1, MAX_LEN), np.int32), layer=5)


# ---------------------------------------------------------------------------------------------------- shuffle

def test_shuffle_equivariance_only_for_position_free_bidirectional(corpus, tmp_path):
    runs = [make_run(corpus, "nopos", "mlm"), make_run(corpus, "nopos", "clm"), make_run(corpus, "sinusoidal", "mlm")]
    report = S.run("/unused", text="the quick brown fox jumps over the lazy dog", out=str(tmp_path), runs=runs)
    gaps = {(r["pe"], r["objective"]): max(r["equivariance_gap"]) for r in report["runs"]}
    assert gaps[("nopos", "mlm")] < 1e-6
    assert gaps[("nopos", "clm")] > 1e-3
    assert gaps[("sinusoidal", "mlm")] > 1e-5
    mlm = report["runs"][0]
    assert mlm["tokens"][0] == "[CLS]" and mlm["permutation"][0] == 0
    assert sorted(mlm["permutation"]) == list(range(len(mlm["tokens"])))
    assert "nll_shuffled" in report["runs"][1]
    assert {"shuffle_attention.json", "shuffle_attention.png"} <= set(os.listdir(tmp_path))
    first = (tmp_path / "shuffle_attention.json").read_bytes()
    S.run("/unused", text="the quick brown fox jumps over the lazy dog", out=str(tmp_path), runs=runs[:1], layer=1)
    assert (tmp_path / "shuffle_attention.json").read_bytes() == first
    assert {"shuffle_attention_layer1.json", "shuffle_attention_layer1.png"} <= set(os.listdir(tmp_path))


# ---------------------------------------------------------------------------------------------------- launcher

def test_launcher_flags_reach_the_analysis_functions(monkeypatch):
    calls = {}

    def fake(name):
        return lambda *args, **kwargs: calls.setdefault(name, (args, kwargs))

    for name in ("extrapolate", "probe", "correlations", "shuffle-attention", "evaluate"):
        monkeypatch.setattr(launch, "resolve", lambda spec: fake(next(n for n, c in launch.COMMANDS.items()
                                                                      if spec == f"{c.module}:{c.function}")))
    assert launch.main(["extrapolate", "--workdir=a", "--workdir=b", "--lengths=8,16", "--mode=sliding",
                        "--stride=4", "--out=o"]) == 0
    assert launch.main(["probe", "--workdir=a", "--probe_steps=7", "--probe_tokens=640"]) == 0
    assert launch.main(["correlations", "--workdir=a", "--layer=1"]) == 0
    assert launch.main(["shuffle-attention", "--workdir=a", "--text=hi there", "--layer=1"]) == 0
    assert launch.main(["evaluate", "--workdir=a", "--config.data.name=wikitext", "--config.data.path=w"]) == 0
    assert calls["extrapolate"] == ((["a", "b"], [8, 16]), {"mode": "sliding", "stride": 4, "out": "o", "step": None,
                                                            "data": {}})
    assert calls["probe"] == ((["a"],), {"out": None, "step": None, "steps": 7, "train_tokens": 640,
                                          "data": {}})
    assert calls["evaluate"] == (("a", None), {"data": {"data.name": "wikitext", "data.path": "w"}})
    assert calls["correlations"][1]["layer"] == 1
    assert calls["shuffle-attention"][1]["text"] == "hi there"
    assert launch.main(["extrapolate", "--workdir=a", "--mode=strided"]) == 2


@pytest.mark.parametrize("process", [0, 1])
def test_only_process_0_uploads_a_bucket_output(tmp_path, monkeypatch, process):
    """On a pod every host runs the analysis and stages the same files: process 0 alone uploads them (the others'
    uploads of the same objects at once would race); every process removes its staging folder."""
    from tupe_jax import files
    from tupe_jax.analysis import common
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "probe.json").write_text("{}")
    monkeypatch.setitem(common._STAGED, str(staging), "gs://bucket/analysis")  # pylint: disable=protected-access
    uploads = []
    monkeypatch.setattr(files, "upload", lambda local, path: uploads.append(path))
    monkeypatch.setattr(common.jax, "process_index", lambda: process)
    assert common.publish(staging) == "gs://bucket/analysis"
    assert uploads == (["gs://bucket/analysis/probe.json"] if process == 0 else [])
    assert not staging.exists()
