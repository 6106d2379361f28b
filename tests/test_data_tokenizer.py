"""WordPiece tokenizer: trains offline on the embedded corpus, fixed special ids, saved and reused."""
import time

import ml_collections
import pytest

from tupe_jax import data as D
from tupe_jax.data.tokenizer import SPECIALS, Tokenizer, learned
from tupe_jax.errors import UserError


def make_config(tmp_path, vocab_size=500):
    c = ml_collections.ConfigDict({"data": D.default_data_config(),
                                   "model": {"vocab_size": vocab_size, "max_len": 64, "objective": "mlm"}})
    c.data.cache_dir = str(tmp_path / "cache")
    return c


def test_trains_offline_fast_and_round_trips(tmp_path):
    c = make_config(tmp_path)
    t0 = time.time()
    tok = D.get_tokenizer(c, tmp_path / "run")
    assert time.time() - t0 < 30
    assert tok.vocab_size == 500
    assert tok.vocab[:5] == list(SPECIALS)
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 1, 2, 3, 4)
    text = "the lambda expression returns a function object."
    ids = tok.encode(text)
    assert ids and min(ids) >= 5  # no specials added
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, "class"]) == [ids, tok.encode("class")]
    assert tok.decode(tok.encode("Upper CASE")) == "upper case"  # lower-cased
    assert tok.encode("[UNK]") == [tok.unk_id]


def test_saved_and_reused_on_resume(tmp_path):
    c = make_config(tmp_path)
    tok = D.get_tokenizer(c, tmp_path / "run")
    vocab_txt = tmp_path / "run" / "tokenizer" / "vocab.txt"
    assert vocab_txt.read_text().splitlines() == tok.vocab
    c.model.vocab_size = 800  # a resumed run keeps the saved vocabulary
    again = D.get_tokenizer(c, tmp_path / "run")
    assert again.vocab == tok.vocab and again.fingerprint == tok.fingerprint


def test_only_process_0_saves_the_run_tokenizer(tmp_path, monkeypatch):
    """Every process of a pod makes the same tokenizer; process 0 alone writes it into the (shared) run folder."""
    import jax
    c = make_config(tmp_path)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    tok = D.get_tokenizer(c, tmp_path / "run")
    assert tok.vocab_size == 500 and not (tmp_path / "run").exists()
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    assert D.get_tokenizer(c, tmp_path / "run").vocab == tok.vocab
    assert (tmp_path / "run" / "tokenizer" / "vocab.txt").read_text().splitlines() == tok.vocab


def test_given_vocab_file(tmp_path):
    vocab = list(SPECIALS) + ["the", "cat", "##s", "sat", "."]
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(vocab) + "\n")
    c = make_config(tmp_path)
    c.data.vocab_file = str(path)
    tok = D.get_tokenizer(c, None)
    assert tok.encode("The cats sat.") == [5, 6, 7, 8, 9]
    assert tok.encode("dog") == [tok.unk_id]
    path.write_text("\n".join(["[UNK]", "[PAD]"] + vocab[2:]) + "\n")   # special ids come from the vocabulary
    assert (Tokenizer.from_file(path).unk_id, Tokenizer.from_file(path).pad_id) == (0, 1)
    path.write_text("\n".join(vocab[1:]) + "\n")
    with pytest.raises(UserError, match=r"lacks the special token\(s\) \[PAD\]"):
        Tokenizer.from_file(path)
    c.data.vocab_file = str(tmp_path / "missing.txt")
    with pytest.raises(UserError, match="not found"):
        D.get_tokenizer(c, None)


def test_training_is_deterministic_across_processes(tmp_path):
    """HF's own trainer breaks ties by hash-map order; ours must give the same vocab in every process."""
    import subprocess
    import sys

    from tupe_jax.data.tokenizer import learn_wordpiece
    counts = {"low": 5, "lower": 2, "newest": 6, "widest": 3, "lowest": 2}
    a = learn_wordpiece(counts, 30)
    assert a == learn_wordpiece(dict(reversed(list(counts.items()))), 30) and a[:5] == list(SPECIALS)
    code = ("import sys, ml_collections, tupe_jax.data as D; c = ml_collections.ConfigDict({'data': "
            "D.default_data_config(), 'model': {'vocab_size': 500}}); c.data.cache_dir = sys.argv[1]; "
            "print(D.get_tokenizer(c, None).fingerprint)")
    here = D.get_tokenizer(make_config(tmp_path), None).fingerprint
    for seed in ("1", "2"):          # each process its own data cache: learned there, not read from this one's
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"cache{seed}")], capture_output=True,
                             text=True, check=True, env={**__import__("os").environ, "PYTHONHASHSEED": seed})
        assert out.stdout.strip().splitlines()[-1] == here


def test_a_learned_vocabulary_is_cached_per_text_and_size(tmp_path, monkeypatch, caplog):
    words = [a + b + c for a in "bcdfg" for b in "aeiou" for c in "lmnrst"]          # 150 distinct words
    texts = [" ".join(words), " ".join(reversed(words[::2]))]
    first = learned(lambda: texts, 120, tmp_path)
    trained = []
    train = Tokenizer.train.__func__
    monkeypatch.setattr(Tokenizer, "train", classmethod(lambda cls, t, n: trained.append(n) or train(cls, t, n)))
    assert learned(lambda: texts, 120, tmp_path).vocab == first.vocab and trained == []      # read from the cache
    assert learned(lambda: texts, 130, tmp_path) and trained == [130]                         # another size
    assert learned(lambda: texts[:1], 120, tmp_path) and trained == [130, 120]                # another text
    (entry,) = [p for p in tmp_path.iterdir() if (p / "vocab.txt").read_text().splitlines() == first.vocab]
    (entry / "vocab.txt").write_text("\n".join(first.vocab[:-1]) + "\n")                      # damaged
    assert learned(lambda: texts, 120, tmp_path).vocab == first.vocab and trained == [130, 120, 120]
    assert "does not match its fingerprint; learning it again" in caplog.text
    assert (entry / "vocab.txt").read_text().splitlines() == first.vocab                      # and repaired


def test_runs_on_one_corpus_share_the_learned_vocabulary(tmp_path, monkeypatch):
    c = make_config(tmp_path)
    tok = D.get_tokenizer(c, tmp_path / "run1")
    monkeypatch.setattr(Tokenizer, "train", classmethod(lambda cls, t, n: pytest.fail("learned again")))
    assert D.get_tokenizer(c, tmp_path / "run2").fingerprint == tok.fingerprint
    assert (tmp_path / "run2" / "tokenizer" / "vocab.txt").read_text().splitlines() == tok.vocab


def test_a_vocabulary_too_small_for_the_alphabet_keeps_the_most_frequent_symbols_and_says_so(caplog):
    """The alphabet was cut in sorted order, where every '##' symbol comes before the letters: at vocab_size 36 a
    text of 41 symbols kept '##0 ... ##u' and no word-initial letter, and 1600 of 1601 tokens were [UNK]."""
    from tupe_jax.data.tokenizer import learn_wordpiece
    rare = {f"{c}{c}{c}{c}": 1 for c in "0123456789bdefghijkl"}            # 40 symbols, each seen 1 or 3 times
    common = {"sat": 50, "mat": 40, "cat": 30, "at": 20, "a": 10}          # s m c a ##a ##t: 6 frequent symbols
    with caplog.at_level("WARNING"):
        vocab = learn_wordpiece({**rare, **common}, len(SPECIALS) + 10)
    assert {"s", "m", "c", "a", "##a", "##t"} <= set(vocab), vocab
    assert "has 46 distinct symbols" in caplog.text and "keeps the 10 most frequent" in caplog.text
    assert vocab.index("[UNK]") not in Tokenizer(vocab).encode("sat mat cat at a")


def test_text_the_normaliser_removes_entirely_is_refused_when_learning():
    """NUL and zero-width characters passed the 'no text' check (not blank) but left the learner nothing: a
    vocabulary of the 5 specials, and pretraining crashed in the masking (no ordinary id to draw)."""
    with pytest.raises(UserError, match=r"^error: the text has no word the tokenizer keeps .*, --config.data.path, "):
        Tokenizer.train(["\x00\x00\x00", "\x01\x02\u200b"], 100)


def test_a_vocab_file_with_a_bom_trailing_or_inner_blank_lines(tmp_path):
    """A BOM made the first token '\\ufeff[PAD]' ('lacks the special token [PAD]'); two blank lines at the end
    added an empty token; splitlines() cut a token at U+2028."""
    good = Tokenizer(list(SPECIALS) + ["a", "##b", "x\u2028y"])
    path = tmp_path / "vocab.txt"
    path.write_bytes(("\ufeff" + "\n".join(good.vocab) + "\n\n\n").encode("utf-8"))
    assert Tokenizer.from_file(path).vocab == good.vocab
    path.write_bytes("\r\n".join(good.vocab).encode("utf-8"))
    assert Tokenizer.from_file(path).vocab == good.vocab
    path.write_text("\n".join(good.vocab[:6] + [""] + good.vocab[6:]), encoding="utf-8")
    with pytest.raises(UserError, match="line 7 is empty"):
        Tokenizer.from_file(path)
