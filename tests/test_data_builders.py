"""TFDS builders (array_record) for the embedded corpus, text_files and wikitext — without TensorFlow."""
import sys

import ml_collections
import pytest

from tupe_jax import data as D
from tupe_jax.data import builders, sources, stamps
from tupe_jax.errors import UserError


def make_config(tmp_path, **data):
    c = ml_collections.ConfigDict({"data": D.default_data_config(),
                                   "model": {"vocab_size": 500, "max_len": 64, "objective": "mlm"}})
    c.data.cache_dir = str(tmp_path / "cache")
    c.data.update(data)
    return c


def test_embedded_builds_without_tensorflow(tmp_path):
    c = make_config(tmp_path)
    splits = {s: D.load_documents(c, s) for s in ("train", "validation", "test")}
    assert "tensorflow" not in sys.modules
    assert len(splits["train"]) > 1000 and len(splits["validation"]) > 50 and len(splits["test"]) > 50
    # a partition of the paragraphs, 1 in 20 each to validation and test
    total = sum(len(v) for v in splits.values())
    assert abs(len(splits["validation"]) - total / 20) <= 1 and abs(len(splits["test"]) - total / 20) <= 1
    assert all(doc.strip() and "\n\n" not in doc for doc in splits["train"])
    # prepared as array_record in the cache dir, reread identically
    files = list((tmp_path / "cache" / "tfds").rglob("*.array_record-*"))
    assert len(files) == 3
    assert D.load_documents(c, "validation") == splits["validation"]
    assert splits["validation"] == list(sources.embedded_documents("validation"))


def _write_blank_line_corpus(root, n_docs):
    root.mkdir()
    docs = [f"document {i} first sentence.\ndocument {i} second sentence." for i in range(n_docs)]
    half = n_docs // 2
    (root / "a.txt").write_text("\n\n".join(docs[:half]) + "\n")
    (root / "b.txt").write_text("\n\n\n".join(docs[half:]) + "\n\n")
    return docs


def test_text_files_holdout_is_deterministic_1_in_200(tmp_path):
    docs = _write_blank_line_corpus(tmp_path / "corpus", 450)
    c = make_config(tmp_path, name="text_files", path=str(tmp_path / "corpus"))
    train, valid = D.load_documents(c, "train"), D.load_documents(c, "validation")
    assert valid == [docs[199], docs[399]]
    assert train == [d for i, d in enumerate(docs) if i % 200 != 199]
    with pytest.raises(UserError, match="split 'test' is not available"):
        D.load_documents(c, "test")
    assert "tensorflow" not in sys.modules


def test_a_holdout_of_1_is_named_for_the_empty_train_split(tmp_path):
    """It said the train split had "no non-blank text" and to "put text in the files"."""
    _write_blank_line_corpus(tmp_path / "corpus", 5)
    c = make_config(tmp_path, name="text_files", path=str(tmp_path / "corpus"), holdout=1)
    with pytest.raises(UserError, match=r"empty \(data.holdout=1 puts every document in validation\), "
                                        r"--config.data.holdout, give data.holdout > 1"):
        D.load_documents(c, "train")


def test_text_files_split_by_file_and_glob(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(3):
        (root / f"doc{i}.md").write_text(f"line one of {i}\n\nline two of {i}\n")
    c = make_config(tmp_path, name="text_files", path=str(root / "*.md"), split_by="file", holdout=0)
    assert D.load_documents(c, "train") == [f"line one of {i}\nline two of {i}" for i in range(3)]


def test_text_files_named_splits(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "train.txt").write_text("t1\n\nt2\n")
    (root / "valid.txt").write_text("v1\n")
    (root / "test.txt").write_text("x1\n")
    c = make_config(tmp_path, name="text_files", path=str(root))
    assert [D.load_documents(c, s) for s in ("train", "validation", "test")] == [["t1", "t2"], ["v1"], ["x1"]]
    (root / "notes.txt").write_text("stray\n")
    with pytest.raises(UserError, match="notes.txt"):
        D.load_documents(c, "train")


def test_text_files_non_utf8_names_file_and_line(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "train.txt").write_bytes(b"fine\nalso fine\nbad \xff byte\n")
    c = make_config(tmp_path, name="text_files", path=str(root))
    with pytest.raises(UserError, match=r"train\.txt:3"):
        D.load_documents(c, "train")


OTHER_BREAKS = "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"   # line breaks to str.splitlines, not to a text file's reader


def test_corpus_lines_end_only_at_newlines_as_a_text_reader_reads_them(tmp_path):
    """Independent reference: Python's universal-newline text reader (what fairseq's reader iterates),
    with each line's newline removed. Random text from words, newlines of the three kinds and the other breaks."""
    import io  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng()
    pieces = ["word", "two words", " ", "", "\n", "\r\n", "\r", "\n\n"] + list(OTHER_BREAKS)
    for trial in range(20):
        text = "".join(pieces[i] for i in rng.integers(0, len(pieces), 60))
        f = tmp_path / f"t{trial}.txt"
        f.write_bytes(text.encode("utf-8"))
        with io.open(f, encoding="utf-8", newline=None) as text_reader:
            reference = [line.removesuffix("\n") for line in text_reader]
        assert sources.read_lines(f) == reference, repr(text)


def test_a_break_inside_or_ending_a_line_cuts_neither_sentence_nor_document(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "train.txt").write_text("first\u2028half and\x85more\x0c\nsame document\n\nsecond doc\u2029\n",
                                    encoding="utf-8")
    c = make_config(tmp_path, name="text_files", path=str(root), holdout=0)
    # one document of two lines, and a second (lines are stripped: \x0c and U+2029 are whitespace at a line's end)
    assert D.load_documents(c, "train") == ["first\u2028half and\x85more\nsame document", "second doc"]


def test_only_a_file_with_another_break_gets_a_new_stamp(tmp_path):
    """The cache key of a corpus without those characters is as before (path, size, sha256); a file with one gets
    a fourth entry, so what was built from lines cut at it is not reused; where lines=False (GLUE), nothing."""
    import hashlib  # pylint: disable=import-outside-toplevel
    plain, straddling = tmp_path / "plain.txt", tmp_path / "straddling.txt"
    plain.write_bytes(b"a\nb\r\n\xc3\xa9\xe2\x80\xa6\n")           # other non-ASCII text: no break
    straddling.write_bytes(b"a" * ((1 << 22) - 1) + "\u2028".encode() + b"\n")   # split across two reads
    expect = [[f.name, f.stat().st_size, hashlib.sha256(f.read_bytes()).hexdigest()] for f in (plain, straddling)]
    assert stamps.file_stamps([plain, straddling], str(tmp_path), lines=True) == [expect[0],
                                                                                     expect[1] + ["newline-only"]]
    assert stamps.file_stamps([plain, straddling], str(tmp_path)) == expect
    for ch in OTHER_BREAKS:
        f = tmp_path / f"one{ord(ch)}.txt"
        f.write_text(f"x{ch}y\n", encoding="utf-8")
        assert stamps.file_stamps([f], str(tmp_path), lines=True)[0][3:] == ["newline-only"], repr(ch)


def test_missing_path_is_user_error(tmp_path):
    c = make_config(tmp_path, name="text_files", path=str(tmp_path / "nope"))
    with pytest.raises(UserError, match="no such file"):
        D.load_documents(c, "train")


WIKI = """
 = Alpha Article = 

 Alpha is a <unk> thing , made in 1 @,@ 000 well @-@ known ways . 

 = = History = = 

 It began in 1 @.@ 5 years . 

 = Beta = 

 Beta text . " Second " one . 
"""


def test_wikitext_articles(tmp_path):
    root = tmp_path / "wt"
    root.mkdir()
    for split in ("train", "valid", "test"):
        (root / f"{split}.txt").write_text(WIKI)
    (root / "PROVENANCE.md").write_text("not text\n")
    c = make_config(tmp_path, name="wikitext", path=str(root))
    docs = D.load_documents(c, "validation")
    assert docs == ["Alpha Article\nAlpha is a [UNK] thing , made in 1,000 well-known ways .\nHistory\n"
                    "It began in 1.5 years .", "Beta\nBeta text .\n\" Second \" one ."]
    assert "tensorflow" not in sys.modules


def test_changed_source_rebuilds(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    f = root / "train.txt"
    f.write_text("old text\n")
    c = make_config(tmp_path, name="text_files", path=str(root))
    assert D.load_documents(c, "train") == ["old text"]
    f.write_text("new text here\n")
    assert D.load_documents(c, "train") == ["new text here"]
    key1 = builders.corpus_fingerprint(c, "train")[0]
    assert key1.startswith("tupe_text_files/")


def test_tfds_prepared_dataset_by_name(tmp_path):
    """`tfds:<name>` reads any array_record dataset under tfds_data_dir via tfds.data_source (no download)."""
    c = make_config(tmp_path)
    b = builders.corpus_builder(c)  # prepare the embedded corpus, then read it back as a plain tfds dataset
    by_name = make_config(tmp_path, name=f"tfds:{b.name}/{b.builder_config.name}",
                          tfds_data_dir=str(tmp_path / "cache" / "tfds"))
    assert D.load_documents(by_name, "validation") == D.load_documents(c, "validation")
    missing = make_config(tmp_path, name="tfds:no_such_dataset", tfds_data_dir=str(tmp_path / "empty"))
    with pytest.raises(UserError, match="tfds build no_such_dataset --file_format=array_record"):
        D.load_documents(missing, "train")
    assert "tensorflow" not in sys.modules


def test_a_dataset_another_process_finished_meanwhile_is_read_whole(tmp_path, monkeypatch):
    """Processes sharing a cache (several per host, or a shared file system): another one may finish preparing the
    dataset between this process making its builder (which reads the dataset's info: none yet) and asking whether
    it is prepared (yes, by then). That builder held no splits ("split 'train' is not available (have [])")."""
    from tupe_jax.data import cache
    _write_blank_line_corpus(tmp_path / "corpus", 450)
    c = make_config(tmp_path, name="text_files", path=str(tmp_path / "corpus"))
    if cache._BUILDER_CLASS is None:   # pylint: disable=protected-access
        cache._BUILDER_CLASS = cache._make_builder_class()   # pylint: disable=protected-access
    base, raced = cache._BUILDER_CLASS, []   # pylint: disable=protected-access

    class Racing(base):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.kwargs = kwargs

        def is_prepared(self):
            if not raced:              # the other process finishes now
                raced.append(True)
                other = base(**self.kwargs)
                other.download_and_prepare(download_config=cache._tfds().download.DownloadConfig(
                    try_download_gcs=False))   # pylint: disable=protected-access
            return super().is_prepared()

    monkeypatch.setattr(cache, "_BUILDER_CLASS", Racing)
    train = D.load_documents(c, "train")
    assert raced and len(train) == 450 - 2


def test_a_corpus_without_a_validation_split_is_one_warning_without_a_nested_error(tmp_path, caplog):
    """The warning quoted the whole one-line error ('no validation split: error: ..., ..., ...')."""
    from tupe_jax.pretrain.loop import validation_batches  # pylint: disable=import-outside-toplevel
    _write_blank_line_corpus(tmp_path / "corpus", 40)
    c = make_config(tmp_path, name="text_files", path=str(tmp_path / "corpus"), holdout=0)
    with caplog.at_level("WARNING"):
        assert validation_batches(c, D.get_tokenizer(c, None), 8) is None
    (line,) = [r.getMessage() for r in caplog.records if "no validation split" in r.getMessage()]
    assert "error:" not in line and "trains without validation losses" in line
