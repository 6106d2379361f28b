"""import-fairseq (issue #19): a checkpoint in the TUPE authors' fairseq format, built here for a tiny config, gives
the MLM logits of an independent NumPy forward pass of their architecture; the official tokenizer path equals
sacremoses + subword-nmt called directly; unsafe pickles are refused without running; fine-tuning runs end to end.
The one-line errors are also in tests/test_errors_catalogue.py."""
import json
import math
import os

import jax
import numpy as np
import pytest

pytest.importorskip("torch", reason="the fairseq extra (pip install -e '.[test]') brings torch")
pytest.importorskip("sacremoses", reason="the fairseq extra brings sacremoses")
pytest.importorskip("subword_nmt", reason=".[test] brings subword-nmt (the independent BPE reference)")

import launch  # noqa: E402
from tests import fairseq_fixtures as F  # noqa: E402
from tests.glue_fixtures import write_glue_dir  # noqa: E402
from tupe_jax import workdir as workdir_lib  # noqa: E402
from tupe_jax.data import fairseq_bpe  # noqa: E402
from tupe_jax.finetune.init_from import MUST_MATCH  # noqa: E402
from tupe_jax.model import TransformerLM  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S = "decoder.sentence_encoder."


def one_line_error(capsys, argv) -> str:
    capsys.readouterr()   # drop what building the fixture printed (subword-nmt's progress bar)
    assert launch.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("fairseq")
    sd = F.write_checkpoint(str(root / "ckpt"))
    assert launch.main(["import-fairseq", f"--from={root / 'ckpt'}", f"--workdir={root / 'run'}"]) == 0
    return {"root": root, "sd": sd, "run": str(root / "run")}


# ------------------------------------------------------------------------------------------------ the reference
def _ln(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _gelu(x):
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def _t5_bucket(i, j, buckets=32, max_distance=128):
    """T5's bidirectional bucket of query i, key j (the TUPE code's relative_position_bucket, written out)."""
    n = i - j
    half = buckets // 2
    out = half if n < 0 else 0
    n = abs(n)
    exact = half // 2
    if n < exact:
        return out + n
    return out + min(half - 1, exact + int(math.log(n / exact) / math.log(max_distance / exact) * (half - exact)))


def official_forward(sd, tokens, heads, rel=True, reset=True, pad=1):
    """The TUPE code's BertModel forward (eval mode) from its semantics, float64: MLM logits (B, L, V)."""
    sd = {k: v.astype(np.float64) for k, v in sd.items()}
    b, length = tokens.shape
    d = sd[f"{S}embed_tokens.weight"].shape[1]
    dh = d // heads
    scale = (2 * dh) ** -0.5
    x = _ln(sd[f"{S}embed_tokens.weight"][tokens], sd[f"{S}emb_layer_norm.weight"], sd[f"{S}emb_layer_norm.bias"])
    x = x * (tokens != pad)[..., None]
    # untied absolute term: LN'd rows 0..L of the table through U^Q, U^K; token t uses row t + 1
    p = _ln(sd[f"{S}pos.weight"][:length + 1], sd[f"{S}pos_ln.weight"], sd[f"{S}pos_ln.bias"])
    pq = (p @ sd[f"{S}pos_q_linear.weight"].T + sd[f"{S}pos_q_linear.bias"]).reshape(length + 1, heads, dh) * scale
    pk = (p @ sd[f"{S}pos_k_linear.weight"].T + sd[f"{S}pos_k_linear.bias"]).reshape(length + 1, heads, dh)
    full = np.einsum("ihd,jhd->hij", pq, pk)
    bias = full[:, 1:, 1:].copy()
    if reset:   # others -> [CLS]: p_1·p_1, then the [CLS] row (incl. the corner): p_0·p_0
        bias[:, :, 0] = full[:, 1, 1][:, None]
        bias[:, 0, :] = full[:, 0, 0][:, None]
    if rel:
        grid = np.array([[_t5_bucket(i, j) for j in range(length)] for i in range(length)])
        grid[:, 0] = 32
        grid[0, :] = 16
        bias = bias + sd[f"{S}relative_attention_bias.weight"][grid].transpose(2, 0, 1)
    keep = tokens != pad
    layer = 0
    while f"{S}layers.{layer}.fc1.weight" in sd:
        w = lambda n: sd[f"{S}layers.{layer}.{n}"]   # noqa: E731
        qkv = x @ w("self_attn.in_proj_weight").T + w("self_attn.in_proj_bias")
        q, k, v = (t.reshape(b, length, heads, dh) for t in np.split(qkv, 3, axis=-1))
        logits = np.einsum("bihd,bjhd->bhij", q * scale, k) + bias[None]
        logits = np.where(keep[:, None, None, :], logits, -np.inf)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("bhij,bjhd->bihd", probs, v).reshape(b, length, d)
        attn = attn @ w("self_attn.out_proj.weight").T + w("self_attn.out_proj.bias")
        x = _ln(x + attn, w("self_attn_layer_norm.weight"), w("self_attn_layer_norm.bias"))
        h = _gelu(x @ w("fc1.weight").T + w("fc1.bias")) @ w("fc2.weight").T + w("fc2.bias")
        x = _ln(x + h, w("final_layer_norm.weight"), w("final_layer_norm.bias"))
        layer += 1
    h = _gelu(x @ sd["decoder.lm_head.dense.weight"].T + sd["decoder.lm_head.dense.bias"])
    h = _ln(h, sd["decoder.lm_head.layer_norm.weight"], sd["decoder.lm_head.layer_norm.bias"])
    return h @ sd[f"{S}embed_tokens.weight"].T + sd["decoder.lm_head.bias"]


def _batch(vocab_rows, length=40):
    """Two sequences <s> ... </s>, the second padded (pad = 1) after 5/8 of the length."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(7, vocab_rows, (2, length)).astype(np.int32)
    tokens[:, 0] = 0
    tokens[0, -1] = 2
    cut = length * 5 // 8
    tokens[1, cut - 1] = 2
    tokens[1, cut:] = 1
    return tokens


# ------------------------------------------------------------------------------------------------ tests
def test_imported_logits_equal_the_official_architecture(imported):
    run = workdir_lib.load_run(imported["run"])
    cfg = run.model_cfg
    assert cfg.pe == "tupe_r" and cfg.untie_cls and cfg.max_len == 64 and cfg.num_heads == 4
    sd = imported["sd"]
    tokens = _batch(run.model_cfg.vocab_size)
    ours = np.asarray(TransformerLM(run.model_cfg).apply({"params": run.params}, tokens, (tokens != 1).astype(np.int32))
                      ["logits"], np.float64)
    ref = official_forward(sd, tokens, heads=4)
    keep = tokens != 1
    diff = float(np.max(np.abs(ours - ref)[keep]))
    # Ours is float32, the reference float64: the gap is float32 rounding grown over the layers, in units of the largest
    # logit. Seen: 6e-6 on AMD CPUs, 1.07e-5 on an Intel one (a different summation order in XLA:CPU's dots), at a
    # logit scale of 12.1, i.e. 4-8 float32 ulps of it. The bound is 32 ulps of the largest logit.
    tol = 32 * float(np.finfo(np.float32).eps) * float(np.abs(ref[keep]).max())
    # the [CLS] reset and the relative buckets are live: without either the reference moves 1e3 times the bound or more
    no_rel = float(np.max(np.abs(official_forward(sd, tokens, heads=4, rel=False) - ref)[keep]))
    no_reset = float(np.max(np.abs(official_forward(sd, tokens, heads=4, reset=False) - ref)[keep]))
    print(f"\nmax |ours - official| = {diff:.2e} (logit scale {np.abs(ref[keep]).max():.1f}); "
          f"without buckets {no_rel:.2f}, without the [CLS] reset {no_reset:.2f}")
    assert diff <= tol
    assert no_rel > 1e3 * tol and no_reset > 1e3 * tol
    assert run.tokenizer.vocab[:7] == F.SPECIALS and run.tokenizer.vocab[-1] == "<mask>"
    assert run.tokenizer.mask_id == run.model_cfg.vocab_size - 1 and run.tokenizer.pad_id == 1


def test_tupe_a_checkpoint_without_rel_pos_legacy_format_float16(tmp_path):
    """No --rel-pos -> tupe_a; the pre-1.6 (non-zip) torch.save format and float16 weights read as well."""
    sd = F.write_checkpoint(str(tmp_path / "ckpt"), args={"rel_pos": False}, seed=4, legacy_format=True, half=True)
    assert launch.main(["import-fairseq", f"--from={tmp_path / 'ckpt' / 'checkpoint_best.pt'}",
                        f"--workdir={tmp_path / 'run'}"]) == 0
    run = workdir_lib.load_run(str(tmp_path / "run"))
    assert run.model_cfg.pe == "tupe_a"
    tokens = _batch(run.model_cfg.vocab_size, length=20)
    ours = TransformerLM(run.model_cfg).apply({"params": run.params}, tokens, (tokens != 1).astype(np.int32))["logits"]
    keep = tokens != 1
    assert np.max(np.abs(np.asarray(ours, np.float64) - official_forward(sd, tokens, 4, rel=False))[keep]) <= 1e-5


def test_tokenizer_equals_sacremoses_and_subword_nmt():
    lines = F.sentences()
    assert len(lines) >= 300
    train = lines[::2]            # codes and dictionary from half the text: the other half meets unseen words
    codes = F.learn_codes(train)
    vocab = fairseq_bpe.read_dictionary(F.make_dict(train, codes))
    tok = fairseq_bpe.FairseqBpeTokenizer(vocab, codes)
    bpe = F.subword_nmt_bpe(codes)
    mismatches = [x for x in lines if tok.encode(x) != F.reference_ids(x, bpe, vocab)]
    assert not mismatches, mismatches[:3]
    assert sum(i == tok.unk_id for x in lines for i in tok.encode(x)) > 0   # unknown pieces -> <unk>
    assert tok.encode("Visit www.example.com now") == [tok.index[p] if p in tok.index else 3 for p in
                                                       tok.pieces("visit < url > now")]


def test_cleanup_steps_follow_the_official_scripts():
    assert fairseq_bpe.pre_cleanup("a\t b....  c <<d>> e,, f,. *g") == "a b... c «d» e, f. g"
    assert fairseq_bpe.split_punctuation("(hello), \"world\"!! x...y") == "( hello ) , \" world \" ! ! x . . . y"
    assert fairseq_bpe.replace_patterns("see www.a.com and a@b.co.uk in notes_1.txt x-y") == \
        "see <url> and <email> in <file> x - y"
    assert fairseq_bpe.apply_bpe("lower", {("l", "o"): 0, ("lo", "w"): 1, ("e", "r</w>"): 2}) == ["low@@", "er"]


def test_glue_pairs_use_the_official_layout(imported):
    from tupe_jax.data.classification import encode_glue
    run = workdir_lib.load_run(imported["run"])
    enc = encode_glue(run.tokenizer, [{"sentence1": "the cat", "sentence2": "a dog", "label": 0}], 64, False)
    ids = enc.tokens.tolist()
    assert ids[0] == 0 and ids[-1] == 2 and ids.count(2) == 3    # <s> a </s> </s> b </s>
    assert ids[1:-1] == run.tokenizer.encode("the cat") + [2, 2] + run.tokenizer.encode("a dog")


def test_unsafe_pickle_is_refused_without_running(tmp_path, capsys):
    victim = tmp_path / "pwned.txt"

    class Evil:
        def __reduce__(self):
            return (open, (str(victim), "w"))

    F.write_checkpoint(str(tmp_path / "ckpt"), extra={"payload": Evil()})
    assert not victim.exists()
    err = one_line_error(capsys, ["import-fairseq", f"--from={tmp_path / 'ckpt'}", f"--workdir={tmp_path / 'run'}"])
    assert "io.open" in err and "allowlist" in err and "--from" in err
    assert not victim.exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("args, needle", [({"encoder_normalize_before": True}, "encoder_normalize_before=True"),
                                          ({"embedding_normalize": False}, "embedding_normalize=False"),
                                          ({"activation_fn": "gelu_accurate"}, "activation_fn='gelu_accurate'"),
                                          ({"arch": "roberta_base"}, "arch='roberta_base'")])
def test_unrepresentable_args_are_refused_naming_them(tmp_path, capsys, args, needle):
    F.write_checkpoint(str(tmp_path / "ckpt"), args=args)
    err = one_line_error(capsys, ["import-fairseq", f"--from={tmp_path / 'ckpt'}", f"--workdir={tmp_path / 'run'}"])
    assert needle in err, err
    assert not (tmp_path / "run").exists()


def test_finetune_from_an_imported_checkpoint_runs_end_to_end_on_rte(imported, tmp_path):
    glue = str(tmp_path / "glue")
    write_glue_dir(glue)
    from launch.interop import finetune_arguments   # what import-fairseq prints for the fine-tune
    config_arg, *model_args = finetune_arguments(imported["run"])
    assert [config_arg, *model_args] == ["--config=configs/glue.py:task=TASK", f"--config.init_from={imported['run']}"]
    argv = ["finetune", config_arg.replace("configs/", f"{ROOT}/configs/").replace("TASK", "rte"),
            f"--workdir={tmp_path / 'rte'}", *model_args, f"--config.data.glue_dir={glue}",
            f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.train.steps=4", "--config.train.batch_size=8",
            "--config.train.eval_batch_size=8", "--config.checkpoint.async_save=false",
            "--config.data.glue_buckets=(64,)"]
    assert launch.main(argv) == 0
    model = json.loads((tmp_path / "rte" / "config.json").read_text())["model"]   # the imported run's model keys
    run_model = workdir_lib.read_config(imported["run"]).model.to_dict()
    assert {k: model[k] for k in MUST_MATCH} == {k: run_model[k] for k in MUST_MATCH}
    results = json.loads((tmp_path / "rte" / "results.json").read_text())
    print(f"\nRTE from an imported fairseq checkpoint: {json.dumps(results)[:200]}")
    assert json.loads((tmp_path / "rte" / "tokenizer" / "tokenizer_config.json").read_text())["tokenizer_class"] \
        == "fairseq_bpe"
    assert (tmp_path / "rte" / "predictions" / "RTE.tsv").is_file()


@pytest.mark.slow
def test_an_imported_run_is_taken_by_evaluate_and_the_analyses(imported, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TUPE_JAX_CACHE", str(tmp_path / "cache"))
    for argv in (["evaluate"], ["correlations"], ["extrapolate", "--lengths=16,64"]):
        assert launch.main(argv + [f"--workdir={imported['run']}", f"--out={tmp_path / argv[0]}"]
                           if argv[0] != "evaluate" else argv + [f"--workdir={imported['run']}"]) == 0, argv
    out = capsys.readouterr().out
    assert "eval_loss" in out and "max |sum - model|" in out and "64: nan" not in out


def test_docs_print_the_fairseq_name_map():
    from tupe_jax.interop.fairseq_names import fairseq_rows
    doc = open(os.path.join(ROOT, "docs", "interop.md"), encoding="utf-8").read()
    for ours, part, theirs, layout in fairseq_rows(1, True):
        ours, theirs = ours.replace("blocks_0", "blocks_{i}"), theirs.replace("layers.0.", "layers.{i}.")
        index = "" if part is None else f"[:, {part}]" if layout == "in_kernel" else f"[{part}]"
        assert f"| `{ours}{index}` | `{theirs}` | {layout} |" in doc


def test_an_archive_or_a_second_import_is_refused_in_one_line(imported, tmp_path, capsys):
    archive = tmp_path / "tupe_ckp.tar.gz"
    archive.write_bytes(b"\x1f\x8b")
    err = one_line_error(capsys, ["import-fairseq", f"--from={archive}", f"--workdir={tmp_path / 'run'}"])
    assert "extract it first" in err and not (tmp_path / "run").exists()
    err = one_line_error(capsys, ["import-fairseq", f"--from={imported['root'] / 'ckpt'}",
                                  f"--workdir={imported['run']}"])
    assert "already exists and is not empty" in err


def test_an_export_of_an_imported_run_reads_back_with_its_bpe_tokenizer(imported, tmp_path, capsys):
    """export of a fairseq-imported run, then import-hf: the same params and the same BPE tokenizer. The export
    labelled the BPE vocabulary BertTokenizer, so it was read back as WordPiece (other ids for the same text)."""
    from tupe_jax.data.tokenizer import Tokenizer
    assert launch.main(["export", f"--workdir={imported['run']}", f"--out={tmp_path / 'export'}"]) == 0
    assert launch.main(["import-hf", f"--from={tmp_path / 'export'}", f"--workdir={tmp_path / 'back'}"]) == 0
    capsys.readouterr()
    text = "The quick brown fox jumps over the lazy dog's back, twice."
    ours, back = (Tokenizer.from_file(os.path.join(d, "tokenizer", "vocab.txt"))
                  for d in (imported["run"], str(tmp_path / "back")))
    assert type(back) is type(ours) and back.encode(text) == ours.encode(text)
    a, b = (workdir_lib.load_run(d).params for d in (imported["run"], str(tmp_path / "back")))
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def test_a_symbol_holding_a_break_other_than_newline_stays_one_symbol():
    """fairseq reads dict.txt and fastBPE its codes by newlines only; `str.splitlines` also cut at U+2028, U+0085
    and \x1c, which refused a released dictionary holding such a symbol (a multilingual vocabulary may)."""
    odd = ["a\u2028b", "c\x85", "\x1cd"]
    vocab = fairseq_bpe.read_dictionary("".join(f"{t} {9 - i}\n" for i, t in enumerate(odd)) + "e 1")
    assert vocab[len(fairseq_bpe.SPECIALS):-1] == odd + ["e"]
    ranks = fairseq_bpe.read_codes("a\u2028 b 7\nc \x85d 5\n")
    assert ranks == {("a\u2028", "b"): 0, ("c", "\x85d"): 1}

