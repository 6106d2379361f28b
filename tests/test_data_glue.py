"""GLUE TSV builders for all nine layouts, malformed rows, batching; the built-in wordorder task."""
import sys

import ml_collections
import numpy as np
import pytest

from tupe_jax import data as D
from tupe_jax.data import classification as glue
from tupe_jax.data.tokenizer import SPECIALS, Tokenizer
from tupe_jax.errors import UserError

T = "\t"
# task → (dir, {file stem: text}), minimal rows in the real layouts
LAYOUTS = {
    "cola": ("CoLA", {"train": "gj04\t1\t\tThe cat sat.\ngj04\t0\t*\tCat the sat.\n",
                      "dev": "gj04\t1\t\tA dog ran.\n",
                      "test": "index\tsentence\n0\tBirds fly.\n"}),
    "sst2": ("SST-2", {"train": "sentence\tlabel\na fine film \t1\ndull \t0\n", "dev": "sentence\tlabel\nok .\t1\n",
                       "test": "index\tsentence\n0\tgreat .\n"}),
    "mrpc": ("MRPC", {"train": "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\tHe left.\tHe went.\n",
                      "dev": "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n0\t3\t4\tA.\tB.\n",
                      "test": "index\t#1 ID\t#2 ID\t#1 String\t#2 String\n0\t5\t6\tC.\tD.\n"}),
    "stsb": ("STS-B", {"train": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
                                "0\tmain\tf\t2012\t0001\tnone\tnone\tA plane.\tAn air plane.\t4.750\n",
                       "dev": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
                              "0\tmain\tf\t2012\t0002\tnone\tnone\tA man.\tA woman.\t1.0\n",
                       "test": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\n"
                               "0\tmain\tf\t2012\t0003\tnone\tnone\tX.\tY.\n"}),
    "qqp": ("QQP", {"train": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n7\t1\t2\tWhy?\tHow?\t0\n",
                    "dev": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n8\t3\t4\tWho?\tWho?\t1\n",
                    "test": "id\tquestion1\tquestion2\n0\tWhat?\tWhen?\n"}),
    "qnli": ("QNLI", {"train": "index\tquestion\tsentence\tlabel\n0\tQ?\tS.\tnot_entailment\n",
                      "dev": "index\tquestion\tsentence\tlabel\n0\tQ2?\tS2.\tentailment\n",
                      "test": "index\tquestion\tsentence\n0\tQ3?\tS3.\n"}),
    "rte": ("RTE", {"train": "index\tsentence1\tsentence2\tlabel\n0\tA b c.\tA b.\tentailment\n1\tX.\tY.\tnot_entailment\n",
                    "dev": "index\tsentence1\tsentence2\tlabel\n0\tP.\tH.\tnot_entailment\n",
                    "test": "index\tsentence1\tsentence2\n0\tP.\tH.\n"}),
    "wnli": ("WNLI", {"train": "index\tsentence1\tsentence2\tlabel\n0\tA.\tB.\t1\n",
                      "dev": "index\tsentence1\tsentence2\tlabel\n0\tC.\tD.\t0\n",
                      "test": "index\tsentence1\tsentence2\n0\tE.\tF.\n"}),
}
MNLI_TRAIN_HEAD = "index\tpromptID\tpairID\tgenre\ts1b\ts2b\ts1p\ts2p\tsentence1\tsentence2\tlabel1\tgold_label\n"
MNLI_DEV_HEAD = ("index\tpromptID\tpairID\tgenre\ts1b\ts2b\ts1p\ts2p\tsentence1\tsentence2\tlabel1\tlabel2\tlabel3\t"
                 "label4\tlabel5\tgold_label\n")
MNLI_TEST_HEAD = "index\tpromptID\tpairID\tgenre\ts1b\ts2b\ts1p\ts2p\tsentence1\tsentence2\n"
LAYOUTS["mnli"] = ("MNLI", {
    "train": MNLI_TRAIN_HEAD + "0\t1\t1e\tgov\tb\tb\tp\tp\tPrem.\tHyp.\tneutral\tneutral\n",
    "dev_matched": MNLI_DEV_HEAD + "0\t1\t1e\tgov\tb\tb\tp\tp\tM.\tH.\tcontradiction\tx\tx\tx\tx\tcontradiction\n",
    "dev_mismatched": MNLI_DEV_HEAD + "0\t1\t1e\tgov\tb\tb\tp\tp\tMM.\tH.\tentailment\tx\tx\tx\tx\tentailment\n",
    "test_matched": MNLI_TEST_HEAD + "0\t1\t1e\tgov\tb\tb\tp\tp\tTM.\tH.\n",
    "test_mismatched": MNLI_TEST_HEAD + "0\t1\t1e\tgov\tb\tb\tp\tp\tTMM.\tH.\n"})


def write_glue(root, tasks=LAYOUTS):
    for task, (d, files) in tasks.items():
        (root / d).mkdir(parents=True, exist_ok=True)
        for stem, text in files.items():
            (root / d / f"{stem}.tsv").write_text(text, encoding="utf-8")
    return root


def make_config(tmp_path, glue_dir="", max_len=32):
    c = ml_collections.ConfigDict({"data": D.default_data_config(),
                                   "model": {"vocab_size": 500, "max_len": max_len, "objective": "mlm"}})
    c.data.cache_dir = str(tmp_path / "cache")
    c.data.glue_dir = str(glue_dir)
    return c


def test_all_nine_layouts(tmp_path):
    c = make_config(tmp_path, write_glue(tmp_path / "glue"))
    ex = {t: {s: D.glue_examples(c, t, s) for s in ("train", "validation", "test")} for t in LAYOUTS}
    assert "tensorflow" not in sys.modules
    assert ex["cola"]["train"] == [{"idx": 0, "sentence1": "The cat sat.", "sentence2": "", "label": 1},
                                   {"idx": 1, "sentence1": "Cat the sat.", "sentence2": "", "label": 0}]
    assert ex["cola"]["test"] == [{"idx": 0, "sentence1": "Birds fly.", "sentence2": "", "label": -1}]
    assert ex["sst2"]["train"][0] == {"idx": 0, "sentence1": "a fine film ", "sentence2": "", "label": 1}
    assert ex["mrpc"]["train"][0] == {"idx": 0, "sentence1": "He left.", "sentence2": "He went.", "label": 1}
    assert ex["stsb"]["train"][0]["label"] == 4.75 and ex["stsb"]["test"][0]["label"] == -1.0
    assert ex["qqp"]["train"][0] == {"idx": 7, "sentence1": "Why?", "sentence2": "How?", "label": 0}
    assert ex["qnli"]["train"][0]["label"] == 1 and ex["qnli"]["validation"][0]["label"] == 0
    assert [e["label"] for e in ex["rte"]["train"]] == [0, 1]
    assert ex["wnli"]["test"][0] == {"idx": 0, "sentence1": "E.", "sentence2": "F.", "label": -1}
    assert ex["mnli"]["train"][0]["label"] == 1
    assert ex["mnli"]["validation"][0]["sentence1"] == "M." and ex["mnli"]["validation"][0]["label"] == 2
    mm = D.glue_examples(c, "mnli", "validation_mismatched")
    assert mm[0]["sentence1"] == "MM." and mm[0]["label"] == 0
    assert D.glue_examples(c, "mnli", "test_mismatched")[0]["label"] == -1
    assert [D.num_labels(t) for t in ("cola", "mnli", "stsb", "wordorder")] == [2, 3, 1, 2]


@pytest.mark.parametrize("task,stem,body,line,match", [
    ("rte", "train", "index\tsentence1\tsentence2\tlabel\n0\tA.\tB.\tentailment\n1\tA.\tentailment\n", 3,
     "3 columns, expected 4"),
    ("rte", "dev", "index\tsentence1\tsentence2\tlabel\n0\tA.\tB.\tmaybe\n", 2, "label 'maybe'"),
    ("cola", "train", "gj04\t1\t\tOk.\ngj04\t1\tOops.\n", 2, "3 columns, expected 4"),
    ("stsb", "train", "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
                      "0\tg\tf\ty\t1\tn\tn\tA.\tB.\thigh\n", 2, "not a number"),
    ("sst2", "train", b"sentence\tlabel\nok\t1\nbad \xe9 byte\t0\n", 3, "not valid UTF-8"),
])
def test_malformed_rows_name_file_and_line(tmp_path, task, stem, body, line, match):
    d = tmp_path / "glue" / LAYOUTS[task][0]
    d.mkdir(parents=True)
    (d / f"{stem}.tsv").write_bytes(body if isinstance(body, bytes) else body.encode())
    c = make_config(tmp_path, tmp_path / "glue")
    split = "train" if stem == "train" else "validation"
    with pytest.raises(UserError, match=match) as err:
        D.glue_examples(c, task, split)
    assert f"{d / stem}.tsv:{line}" in str(err.value)
    assert str(err.value).startswith("error: ")


@pytest.mark.parametrize("task,header", [("rte", "sentence1\tsentence2"), ("qqp", "question1\tquestion2")])
def test_a_test_file_without_its_id_column_is_refused(tmp_path, task, header):
    """Its rows were numbered 0, 1, ... instead: a submission file misaligned with the official ids, exit 0."""
    from tupe_jax.data import glue_tsv  # pylint: disable=import-outside-toplevel
    path = tmp_path / "test.tsv"
    path.write_text(f"{header}\nA.\tB.\n")
    with pytest.raises(UserError, match=r"GLUE header lacks column\(s\) \['(index|id)'\]"):
        list(glue_tsv.parse_tsv(path, task, "test"))
    path.write_text(f"{'index' if task == 'rte' else 'id'}\t{header}\n23\tA.\tB.\n")
    assert [e["idx"] for e in glue_tsv.parse_tsv(path, task, "test")] == [23]


@pytest.mark.parametrize("task,body,line,match", [
    ("rte", "index\tsentence1\tsentence2\n4\tA.\tB.\n4\tC.\tD.\n", 3, "GLUE test id 4 is on line 2 too"),
    ("rte", "index\tsentence1\tsentence2\n-5\tA.\tB.\n", 2, r"GLUE id -5 is outside 0..2\^31-1"),
    ("qqp", "id\tquestion1\tquestion2\n3000000000\tA?\tB?\n", 2, "GLUE id 3000000000 is outside"),
    ("rte", "index\tsentence1\tsentence1\n0\tA.\tB.\n", 1, "names column 'sentence1' twice"),
])
def test_test_ids_a_submission_cannot_hold_are_refused(tmp_path, task, body, line, match):
    """A duplicate id gave two lines of one id in the submission; an id past int32 crashed as "unexpected"; a
    column named twice was read from its last copy."""
    from tupe_jax.data import glue_tsv  # pylint: disable=import-outside-toplevel
    path = tmp_path / "test.tsv"
    path.write_text(body)
    with pytest.raises(UserError, match=match) as err:
        list(glue_tsv.parse_tsv(path, task, "test"))
    assert f"{path}:{line}" in str(err.value)


@pytest.mark.parametrize("task,header,row", [("sst2", "index\tsentence", "100\tgreat ."),
                                             ("cola", "index\tsentence", "7\tBirds fly."),
                                             ("mrpc", "index\t#1 ID\t#2 ID\t#1 String\t#2 String", "9\t5\t6\tC.\tD.")])
def test_test_ids_of_the_tasks_without_train_ids_are_the_files(tmp_path, task, header, row):
    """SST-2, CoLA and MRPC test rows were numbered 0, 1, ... whatever their index column said."""
    from tupe_jax.data import glue_tsv  # pylint: disable=import-outside-toplevel
    path = tmp_path / "test.tsv"
    path.write_text(f"{header}\n{row}\n")
    assert [e["idx"] for e in glue_tsv.parse_tsv(path, task, "test")] == [int(row.split("\t")[0])]


def test_an_empty_dev_file_is_called_empty(tmp_path):
    c = make_config(tmp_path, write_glue(tmp_path / "glue", {"rte": LAYOUTS["rte"]}))
    (tmp_path / "glue" / "RTE" / "dev.tsv").write_bytes(b"")
    with pytest.raises(UserError, match="GLUE file is empty"):      # it said "has a header and no rows"
        D.glue_examples(c, "rte", "validation")


def test_missing_split_is_user_error(tmp_path):
    c = make_config(tmp_path, write_glue(tmp_path / "glue", {"rte": LAYOUTS["rte"]}))
    (tmp_path / "glue" / "RTE" / "test.tsv").unlink()
    with pytest.raises(UserError, match="not available"):
        D.glue_examples(c, "rte", "test")


def test_truncation_is_longest_first():
    rng = np.random.default_rng(0)
    for _ in range(300):
        la, lb, budget = (int(x) for x in rng.integers(0, 40, 3))
        a, b = la, lb
        while a + b > budget:
            if a > b:
                a -= 1
            else:
                b -= 1
        ta, tb = glue.truncate_lengths(np.array([la]), np.array([lb]), budget)
        assert (ta[0], tb[0]) == (a, b), (la, lb, budget)


def tiny_tokenizer():
    words = "the a b c x y p h cat sat dog ran birds fly plane man woman air why how who . ? ,".split()
    return Tokenizer(list(SPECIALS) + sorted(set(words)))


def test_batches_layout_padding_and_processes(tmp_path):
    rows = "".join(f"{i}\tthe cat sat {'the ' * (i // 4 * 4)}.\ta dog ran .\t{'entailment' if i % 2 else 'not_entailment'}\n"
                   for i in range(11))
    write_glue(tmp_path / "glue", {"rte": ("RTE", {"dev": "index\tsentence1\tsentence2\tlabel\n" + rows})})
    c = make_config(tmp_path, tmp_path / "glue", max_len=24)
    c.data.glue_buckets = (8, 12, 16)
    tok = tiny_tokenizer()
    one = list(D.glue_batches(c, tok, "rte", "validation", batch_size=4, process_index=0, process_count=1))
    assert len(one) == 3
    b = one[0]
    assert b.inputs.dtype == np.int32 and b.label.dtype == np.int32
    first = [2] + tok.encode("the cat sat .") + [3] + tok.encode("a dog ran .") + [3]
    np.testing.assert_array_equal(b.inputs[0], first + [0] * (12 - len(first)))
    np.testing.assert_array_equal(b.input_mask[0], [1] * len(first) + [0] * (12 - len(first)))
    assert b.inputs[0][0] == tok.cls_id and (b.inputs == tok.sep_id).sum(1).tolist() == [2, 2, 2, 2]
    a_part = 2 + len(tok.encode("the cat sat ."))     # BERT's token types: [CLS] a [SEP] 0, b [SEP] 1, padding 0
    np.testing.assert_array_equal(b.segments[0], [0] * a_part + [1] * (len(first) - a_part) + [0] * (12 - len(first)))
    for x in one:
        sep_at = np.argmax(x.inputs == tok.sep_id, axis=1)      # the first [SEP] closes segment 0
        after = np.arange(x.inputs.shape[1])[None, :] > sep_at[:, None]
        np.testing.assert_array_equal(x.segments, (after & (x.input_mask > 0) & (x.example_weight[:, None] > 0)))
    assert [x.inputs.shape[1] for x in one] == [12, 16, 24]  # buckets; max_len always allowed
    assert (one[2].example_weight == [1, 1, 1, 0]).all() and one[2].example_index[3] == -1
    seen = np.concatenate([x.example_index[x.example_weight > 0] for x in one])
    np.testing.assert_array_equal(np.sort(seen), np.arange(11))
    assert one[0].label.tolist() == [1, 0, 1, 0]  # not_entailment = 1
    # two processes: disjoint rows whose interleaving is the global batch, same bucket width
    two = [list(D.glue_batches(c, tok, "rte", "validation", batch_size=4, process_index=p, process_count=2))
           for p in range(2)]
    for g, h0, h1 in zip(one, *two):
        assert h0.inputs.shape == h1.inputs.shape == (2, g.inputs.shape[1])
        np.testing.assert_array_equal(np.stack([h0.inputs, h1.inputs], 1).reshape(g.inputs.shape),
                                      g.inputs)
    # training: shuffled by (seed, epoch), remainder dropped
    tr = list(D.glue_batches(c, tok, "rte", "validation", batch_size=4, shuffle=True, seed=1, process_index=0,
                             process_count=1))
    assert len(tr) == 2 and all(x.example_weight.all() for x in tr)


def test_examples_cut_to_max_len_are_counted_aloud(tmp_path, capsys):
    rows = "".join(f"{i}\tthe cat sat {'the ' * i}.\ta dog ran .\tentailment\n" for i in range(11))
    write_glue(tmp_path / "glue", {"rte": ("RTE", {"dev": "index\tsentence1\tsentence2\tlabel\n" + rows})})
    c = make_config(tmp_path, tmp_path / "glue", max_len=12)
    tok = tiny_tokenizer()
    longer = sum(3 + len(tok.encode(f"the cat sat {'the ' * i}.")) + len(tok.encode("a dog ran .")) > 12
                 for i in range(11))
    assert 0 < longer < 11
    list(D.glue_batches(c, tok, "rte", "validation", batch_size=4, process_index=0, process_count=1))
    assert f"data: rte validation: {longer} of 11 examples cut to max_len 12 tokens" in capsys.readouterr().out


def test_wordorder_task(tmp_path):
    c = make_config(tmp_path, max_len=64)
    val = D.glue_examples(c, "wordorder", "validation")
    assert len(val) > 50
    labels = np.array([e["label"] for e in val])
    assert 0.3 < labels.mean() < 0.7
    assert all(e["sentence2"] == "" for e in val)
    assert all(e["label"] == -1 for e in D.glue_examples(c, "wordorder", "test"))
    shuffled = [e["sentence1"] for e in val if e["label"] == 0]
    assert shuffled and all(len(s.split()) >= 8 for s in shuffled)


@pytest.mark.parametrize("split", ["validation", "test"])
def test_wordorder_held_out_sentences_never_occur_in_the_train_text(tmp_path, split):
    """The pydoc topics repeat sentences word for word (35 of the 126 validation sentences used to occur in the
    train split): a held-out sentence must be new to pretraining and to word-order training, and occur once."""
    c = make_config(tmp_path, max_len=64)
    originals = [e["sentence1"] for e in D.glue_examples(c, "wordorder", split)[0::2]]
    train_text = "\n".join(D.load_documents(c, "train"))
    assert len(originals) >= 80 and len(set(originals)) == len(originals)
    assert [s for s in originals if s in train_text] == []
    # the train split keeps every sentence, repeats included (what the behaviour golden run fine-tunes on)
    train = [e["sentence1"] for e in D.glue_examples(c, "wordorder", "train")[0::2]]
    assert len(set(train)) < len(train)


@pytest.mark.parametrize("split", ["train", "validation", "test"])
def test_wordorder_label0_is_a_window_permutation_of_its_label1_pair(tmp_path, split):
    """`sources.wordorder_examples`: examples come in pairs (idx 2j: the sentence as is, label 1; idx 2j+1: the
    same sentence with the words of every aligned 3-word window [3i, 3i+3) permuted, label 0; test labels -1).
    So the pair has the same words overall AND within each aligned window (the last may hold 1-2 words); a window
    with two distinct words is never left as it was, a window of one repeated word can only stay; hence the
    shuffled sentence differs from the original exactly when some window has two distinct words. The original is
    a prose sentence of 8-40 words from the embedded corpus split of the same name."""
    c = make_config(tmp_path, max_len=64)
    ex = D.glue_examples(c, "wordorder", split)
    assert len(ex) >= 160 and len(ex) % 2 == 0
    assert [e["idx"] for e in ex] == list(range(len(ex)))
    assert [e["label"] for e in ex] == ([-1, -1] if split == "test" else [1, 0]) * (len(ex) // 2)
    assert all(e["sentence2"] == "" for e in ex)
    corpus = "\n".join(D.load_documents(c, split))
    changed_somewhere = 0
    for orig, shuf in zip(ex[0::2], ex[1::2]):
        w, s = orig["sentence1"].split(), shuf["sentence1"].split()
        assert 8 <= len(w) <= 40 and orig["sentence1"] in corpus, orig
        assert len(s) == len(w) and sorted(s) == sorted(w)
        for i in range(0, len(w), 3):
            win, got = w[i:i + 3], s[i:i + 3]
            assert sorted(got) == sorted(win), (orig, shuf, i)
            if len(set(win)) > 1:
                assert got != win, (orig, shuf, i)
        assert (s != w) == any(len(set(w[i:i + 3])) > 1 for i in range(0, len(w), 3))
        changed_somewhere += s != w
    assert changed_somewhere == len(ex) // 2  # in practice every prose sentence has such a window


def test_single_sentence_batches_are_one_segment(tmp_path):
    write_glue(tmp_path / "glue", {"sst2": LAYOUTS["sst2"]})
    c = make_config(tmp_path, tmp_path / "glue", max_len=16)
    batch = next(iter(D.glue_batches(c, tiny_tokenizer(), "sst2", "train", batch_size=2, shuffle=False,
                                     process_index=0, process_count=1)))
    assert batch.segments.shape == batch.inputs.shape and not batch.segments.any()
