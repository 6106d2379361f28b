"""Our WordPiece on BERT's vocabulary layout ([PAD] 0, [unused..], [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103)
gives the ids of transformers' BertTokenizerFast, on GLUE text (from ../shared/data/glue when present) and on
generated text (always), single sentences and [CLS] a [SEP] b [SEP] pairs through the GLUE encoder."""
import json
import os

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[test]') brings it")

from tests import hf_fixtures as F  # noqa: E402
from tupe_jax.data import classification, glue_tsv, masking  # noqa: E402
from tupe_jax.data.tokenizer import Tokenizer  # noqa: E402


def hf_tokenizer(folder, lowercase=True):
    return transformers.BertTokenizerFast(vocab_file=os.path.join(folder, "vocab.txt"), do_lower_case=lowercase)


def glue_rows(tokenizer, pairs):
    """Our GLUE encoder's [CLS] a [SEP] (b [SEP]) rows (no truncation)."""
    examples = [{"sentence1": a, "sentence2": b, "label": 0} for a, b in pairs]
    enc = classification.encode_glue(tokenizer, examples, 10 ** 6, regression=False)
    return [enc.tokens[s:e].tolist() for s, e in zip(enc.offsets[:-1], enc.offsets[1:])]


def assert_same_ids(ours, theirs, pairs):
    """Single sentences via `encode`, and the GLUE rows (pairs when every b is given) against HF's __call__."""
    for a, b in pairs:
        assert ours.encode(a) == theirs(a, add_special_tokens=False)["input_ids"], a
    for group in ([p for p in pairs if not p[1]], [p for p in pairs if p[1]]):   # one task is single or paired
        rows = glue_rows(ours, group) if group else []
        hf_rows = [theirs(a, b or None)["input_ids"] for a, b in group]
        bad = [(p, r, h) for p, r, h in zip(group, rows, hf_rows) if r != h]
        assert not bad, bad[:2]


def test_special_ids_come_from_a_bert_layout_vocabulary(tmp_path):
    vocab = F.bert_layout_vocab(F.generated_texts(200), 300)
    tok = Tokenizer.from_file(F.write_vocab(tmp_path, vocab))
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 100, 101, 102, 103)
    assert tok.special_ids == tuple(range(104))   # the five and [unused0..98]: never masked nor sampled
    # GLUE batches: [CLS]/[SEP] and padding are the vocabulary's
    enc = classification.encode_glue(tok, [{"sentence1": "the cat", "sentence2": "sat", "label": 1},
                                           {"sentence1": "a", "sentence2": "dog ran quickly over", "label": 0}],
                                     32, regression=False)
    batch = next(iter(classification.GlueBatches(enc, batch_size=2, max_len=32, buckets=(32,), shuffle=False,
                                                  seed=0, epoch=0, drop_remainder=False, process_index=0,
                                                  process_count=1)))
    assert (batch.inputs[:, 0] == 101).all() and ((batch.inputs == 102).sum(1) == 2).all()
    assert (batch.inputs[batch.input_mask == 0] == 0).all()
    # MLM masking with the tokenizer's ids: [MASK] is 103 and no special or [unused] id is ever picked
    ids = np.asarray([tok.encode(t)[:30] + [tok.pad_id] * (30 - len(tok.encode(t)[:30]))
                      for t in F.generated_texts(64, seed=1)], np.int64)
    valid = (np.arange(30)[None] < np.array([[min(len(tok.encode(t)), 30)] for t in F.generated_texts(64, seed=1)]))
    ids, valid = masking.add_cls(ids, valid, tok.cls_id)
    out = masking.mask_tokens(ids, valid.astype(np.int32), masking.example_keys(0, np.arange(64), np.zeros(64)),
                              vocab_size=len(vocab), mask_prob=0.3, max_predictions=10,
                              special_ids=tok.special_ids, mask_id=tok.mask_id)
    changed = out.inputs[(out.weights > 0) & (out.inputs != out.targets)]
    assert (changed == 103).any() and not np.isin(changed[changed != 103], range(104)).any()
    assert not np.isin(out.targets[out.weights > 0], tok.special_ids).any()


def test_wordpiece_equals_bert_tokenizer_fast_on_generated_text(tmp_path):
    texts = F.generated_texts(600)
    vocab = F.bert_layout_vocab(texts[:300], 400)   # learned on half: the rest meets unseen pieces and [UNK]
    path = F.write_vocab(tmp_path / "uncased", vocab)
    pairs = list(zip(texts[::2], texts[1::2])) + [(t, "") for t in texts[:50]]
    assert_same_ids(Tokenizer.from_file(path), hf_tokenizer(tmp_path / "uncased"), pairs)
    assert any(Tokenizer.from_file(path).unk_id in Tokenizer.from_file(path).encode(t) for t in texts)


def test_cased_vocab_follows_its_tokenizer_config(tmp_path):
    texts = F.generated_texts(400, seed=5)
    cased = F.BERT_SPECIALS + Tokenizer.train(texts[:200], 305).vocab[5:]
    vocab = list(dict.fromkeys(cased + sorted({w for t in texts for w in t.split()})))[:2000]
    folder = tmp_path / "cased"
    F.write_vocab(folder, vocab)
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False, "strip_accents": None}))
    ours = Tokenizer.from_file(folder / "vocab.txt")
    assert not ours.lowercase and ours.encode("Café") != ours.encode("café")
    assert ours.fingerprint != Tokenizer(vocab).fingerprint   # the casing is part of the tokenizer's identity
    assert_same_ids(ours, hf_tokenizer(folder, lowercase=False), [(t, "") for t in texts] +
                    list(zip(texts[::2], texts[1::2])))
    ours.save(tmp_path / "saved")                             # and a run keeps it
    assert Tokenizer.from_file(tmp_path / "saved" / "vocab.txt").fingerprint == ours.fingerprint


@pytest.mark.skipif(not os.path.isdir(F.SHARED_GLUE), reason=f"the GLUE TSVs are not at {F.SHARED_GLUE}")
def test_wordpiece_equals_bert_tokenizer_fast_on_all_sst2_and_mrpc_dev(tmp_path):
    sst2 = [(r["sentence1"], "") for r in glue_tsv.parse_tsv(os.path.join(F.SHARED_GLUE, "SST-2", "dev.tsv"),
                                                             "sst2", "validation")]
    mrpc = [(r["sentence1"], r["sentence2"]) for r in
            glue_tsv.parse_tsv(os.path.join(F.SHARED_GLUE, "MRPC", "dev.tsv"), "mrpc", "validation")]
    assert len(sst2) == 872 and len(mrpc) == 408
    train = [r["sentence1"] for r, _ in zip(glue_tsv.parse_tsv(
        os.path.join(F.SHARED_GLUE, "SST-2", "train.tsv"), "sst2", "train"), range(4000))]
    train += [r["sentence1"] + " " + r["sentence2"] for r in glue_tsv.parse_tsv(
        os.path.join(F.SHARED_GLUE, "MRPC", "train.tsv"), "mrpc", "train")]
    path = F.write_vocab(tmp_path, F.bert_layout_vocab(train, 3000))   # learned on train text, compared on dev
    assert_same_ids(Tokenizer.from_file(path), hf_tokenizer(tmp_path), sst2 + mrpc)
