"""Damaged, unreadable or mistaken data inputs: a rerun of `prepare` repairs what it can (a missing shard, a damaged
sidecar) and refuses the rest in one line (a damaged manifest, a file that is not one); unreadable corpora and
shards are one-line errors, not tracebacks or a wrong diagnosis; a data.path the corpus would not read and a
negative holdout are refused. The one-line errors of whole commands are rows of the errors catalogue too."""
import json
import os
import shutil

import ml_collections
import pytest

import launch
from tests.glue_fixtures import ROOT
from tests.test_data_prepare import prepare_args, run_config, write_corpus
from tupe_jax import data as D
from tupe_jax.data import prepare as P
from tupe_jax.data import prepared as R
from tupe_jax.data import sources
from tupe_jax.errors import UserError


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(corpus, the folder `launch prepare` made of it): copied by each test that damages it."""
    tmp = tmp_path_factory.mktemp("repairs")
    corpus = write_corpus(tmp / "corpus")
    assert launch.main(prepare_args(corpus, tmp / "out")) == 0
    return corpus, tmp / "out"


def run_launch(args, capsys):
    """(exit code, stdout, stderr) of `python -m launch ARGS` run in-process from the repo root."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        rc = launch.main(args)
    finally:
        os.chdir(cwd)
    out, err = capsys.readouterr()
    return rc, out, err.strip()


def test_a_rerun_writes_a_shard_the_manifest_lists_but_the_folder_lost(made, tmp_path, capsys):
    corpus, done = made
    out = tmp_path / "out"
    shutil.copytree(done, out)
    (out / "train" / "shard-00001.array_record").unlink()
    with pytest.raises(UserError, match="rerun `launch prepare` on the directory"):
        D.validate_config(run_config(out))
    rc, printed, err = run_launch(prepare_args(corpus, out), capsys)
    assert rc == 0, err
    assert "1 shards missing or changed (train/shard-00001.array_record); writing them again" in printed
    a, b = (json.loads((d / "manifest.json").read_text()) for d in (out, done))
    assert a["splits"] == b["splits"] and a["settings"] == b["settings"]
    assert (out / "train" / "shard-00001.array_record").read_bytes() == \
        (done / "train" / "shard-00001.array_record").read_bytes()
    D.validate_config(run_config(out))


def test_a_damaged_sidecar_is_written_again_and_a_damaged_manifest_is_refused(made, tmp_path, capsys):
    corpus, done = made
    out = tmp_path / "out"
    shutil.copytree(done, out)
    (out / "manifest.json").unlink()
    (out / "train" / "shard-00002.json").write_text('{"settings": ')
    rc, printed, err = run_launch(prepare_args(corpus, out), capsys)
    assert rc == 0, err
    assert "shard-00002.json is damaged; writing that shard again" in printed
    assert (out / "train" / "shard-00002.json").read_bytes() == (done / "train" / "shard-00002.json").read_bytes()
    for text, needle in (("", "is not valid JSON"), ("{}", "is not a prepare manifest"), ("[1, 2]", "not a prepare")):
        (out / "manifest.json").write_text(text)
        before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        rc, _, err = run_launch(prepare_args(corpus, out), capsys)
        assert rc == 2 and needle in err and "delete" in err and "\n" not in err, err
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
        with pytest.raises(UserError, match=needle):          # and a run reading it
            D.validate_config(run_config(out))


def test_unreadable_corpus_and_shard_are_one_line_errors(made, tmp_path, monkeypatch):
    """chmod 000 does not stop root (these tests may run as root): the reads are made to fail instead."""
    _, done = made
    corpus = write_corpus(tmp_path / "corpus", docs=16)

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(type(corpus), "read_bytes", denied)
    with pytest.raises(UserError, match=r"^error: cannot read .*train.txt \(Permission denied\), "
                                        r"--config.data.path, fix its permissions"):
        sources.read_lines(corpus / "train.txt")
    monkeypatch.setattr(type(corpus), "iterdir", denied)
    with pytest.raises(UserError, match=r"cannot read .*corpus \(Permission denied\)"):
        sources.find_files(str(corpus))
    monkeypatch.undo()
    shard = str(done / "train" / "shard-00000.array_record")
    real_open = open

    def shard_denied(path, *args, **kwargs):
        if str(path) == shard:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(R, "open", shard_denied, raising=False)
    with pytest.raises(UserError, match=r"cannot read shard shard-00000.array_record of train \(Permission denied"):
        D.validate_config(run_config(done))


@pytest.mark.parametrize("name", ["embedded", "tfds:wikipedia"])
def test_a_data_path_the_corpus_would_not_read_and_a_negative_holdout_are_refused(made, name):
    _, done = made
    config = run_config(done)
    config.data.name = name
    with pytest.raises(UserError, match=f"data.path=.* is set but data.name='{name}' does not read it, "
                                        "--config.data.name"):
        D.validate_config(config)
    config.data.path = ""
    config.data.holdout = -5
    with pytest.raises(UserError, match="data.holdout = -5 is negative"):
        D.validate_config(config)
    for reads_path in ("text_files", "wikitext", "prepared"):
        config = run_config(done)
        config.data.name = reads_path
        sources.check_source(config.data)


def test_a_file_pattern_beside_a_file_or_a_glob_path_is_refused(tmp_path):
    """The pattern was ignored without a word: a file or glob data.path read whatever it named."""
    (tmp_path / "a.txt").write_text("one\n")
    data = ml_collections.ConfigDict({"name": "text_files", "path": str(tmp_path / "a.txt"), "holdout": 0,
                                      "file_pattern": "*.md"})
    with pytest.raises(UserError, match=r"data.file_pattern='\*.md' is set but data.path .*a.txt' is a file"):
        sources.check_source(data)
    data.path = str(tmp_path / "*.txt")
    with pytest.raises(UserError, match=r"is a glob: the pattern applies inside a data.path folder only"):
        sources.check_source(data)
    data.path = str(tmp_path)
    sources.check_source(data)              # a folder: the pattern applies there


def test_no_leftover_in_the_prepared_folder_after_a_refusal(made, tmp_path, capsys):
    """A prepared folder's manifest counts as results: --overwrite_config is refused on it (it was suggested, and
    taking it rewrote config.json to settings the manifest does not have)."""
    corpus, done = made
    out = tmp_path / "out"
    shutil.copytree(done, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    rc, _, err = run_launch(prepare_args(corpus, out, max_len=64), capsys)
    assert rc == 2 and "--overwrite_config" not in err, err
    rc, _, err = run_launch(prepare_args(corpus, out, "--overwrite_config", max_len=64), capsys)
    assert rc == 2 and "--overwrite_config would misrepresent" in err, err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert os.listdir(out) == os.listdir(done)


def test_a_corpus_copied_back_with_new_times_resumes_and_legacy_stamps_are_recognised(made, tmp_path, capsys):
    """The source is stamped by content: an interrupted prepare resumes on its corpus copied back in place (new
    mtimes; a fresh VM), and a folder stamped the old way (absolute path + mtime) still resumes on those files."""
    corpus, done = made
    for f in corpus.iterdir():
        os.utime(f, (1e9, 1e9))
    out = tmp_path / "out"
    shutil.copytree(done, out)
    for name in ("manifest.json", "train/shard-00002.json", "train/shard-00002.array_record"):
        (out / name).unlink()
    rc, _, err = run_launch(prepare_args(corpus, out), capsys)
    assert rc == 0, err
    assert (out / "train" / "shard-00002.array_record").read_bytes() == \
        (done / "train" / "shard-00002.array_record").read_bytes()
    assert json.loads((out / "manifest.json").read_text())["splits"] == \
        json.loads((done / "manifest.json").read_text())["splits"]

    legacy = tmp_path / "legacy"                    # the same folder as a version with mtime stamps left it
    shutil.copytree(done, legacy)
    config = run_config(corpus)
    config.data.name, config.data.path, config.prepare = "text_files", str(corpus), {"shard_mb": 0.004}
    tok = D.Tokenizer.from_file(done / "tokenizer" / "vocab.txt")
    old = P.settings_of(config, tok, legacy=True)
    assert old["fingerprint"] != P.settings_of(config, tok)["fingerprint"]
    manifest = json.loads((legacy / "manifest.json").read_text())
    (legacy / "manifest.json").write_text(json.dumps({**manifest, "settings": old}))
    for side in legacy.rglob("shard-*.json"):
        side.write_text(json.dumps({**json.loads(side.read_text()), "settings": old["fingerprint"]}))
    rc, printed, err = run_launch(prepare_args(corpus, legacy), capsys)
    assert rc == 0 and "is complete" in printed, err
    (legacy / "manifest.json").unlink()
    (legacy / "train" / "shard-00001.array_record").unlink()
    rc, _, err = run_launch(prepare_args(corpus, legacy), capsys)
    assert rc == 0, err
    assert (legacy / "train" / "shard-00001.array_record").read_bytes() == \
        (done / "train" / "shard-00001.array_record").read_bytes()
    (corpus / "train.txt").write_text((corpus / "train.txt").read_text() + "\nan edited corpus\n")
    try:                                            # an edited file is another corpus: refused
        (legacy / "manifest.json").unlink()
        rc, _, err = run_launch(prepare_args(corpus, legacy), capsys)
        assert rc == 2 and "was learned on other text than data.path holds now" in err, err
    finally:
        (corpus / "train.txt").write_text((corpus / "train.txt").read_text().replace("\nan edited corpus\n", ""))


def test_broken_links_in_a_corpus_folder_are_named(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", docs=8)
    os.symlink(tmp_path / "nowhere.txt", corpus / "gone.txt")
    found = sources.find_files(str(corpus))
    assert [f.name for f in found] == ["train.txt", "valid.txt"]
    assert "warning: data.path: 1 broken link(s) skipped: " in capsys.readouterr().out


def test_links_keep_their_names_and_a_file_found_twice_is_refused(tmp_path):
    """Links were resolved before their split was read from the name: `valid.txt -> raw/wiki_b.txt` became
    training text; and a folder link back up (`sub/up -> ..`) under a `**` glob read each file 41 times."""
    raw = write_corpus(tmp_path / "raw", docs=8)
    os.rename(raw / "train.txt", raw / "wiki_a.txt")
    os.rename(raw / "valid.txt", raw / "wiki_b.txt")
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(raw / "wiki_a.txt", linked / "train.txt")
    os.symlink(raw / "wiki_b.txt", linked / "valid.txt")
    found = sources.find_files(str(linked))
    assert [f.name for f in found] == ["train.txt", "valid.txt"] and all(f.parent == linked for f in found)
    assert sorted(sources.assign_files(found)[0]) == ["train", "validation"]
    (raw / "sub").mkdir()
    os.symlink(raw, raw / "sub" / "up")
    with pytest.raises(UserError, match=r"^error: data.path names one file twice: .* are the same file \(a link\), "
                                        r"--config.data.path, "):
        sources.find_files(str(raw) + "/**/*.txt")
    os.symlink(raw / "wiki_a.txt", linked / "more-train.txt")
    with pytest.raises(UserError, match="names one file twice"):
        sources.find_files(str(linked))


def test_a_prepare_stopped_after_learning_its_vocabulary_refuses_an_edited_corpus(made, tmp_path, capsys):
    """Killed after tokenizer/vocab.txt was written and before any shard: the rerun reused the vocabulary learned on
    the text as it was (no shard carried the source stamp yet), so an edit's new words became [UNK]. The vocabulary
    now records the text it was learned on; an edit is refused, and the same text resumes."""
    corpus, done = made
    out = tmp_path / "out"
    shutil.copytree(done, out)
    assert (out / "tokenizer" / "learned_from.json").is_file()
    for name in os.listdir(out):         # as a kill after the vocabulary, before the first shard
        if name != "tokenizer":
            (shutil.rmtree if (out / name).is_dir() else os.remove)(out / name)
    text = (corpus / "train.txt").read_text()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    try:
        (corpus / "train.txt").write_text(text.replace("alpha", "xyzzy"))
        rc, _, err = run_launch(prepare_args(corpus, out), capsys)
        assert rc == 2 and "tokenizer/vocab.txt was learned on other text than data.path holds now" in err, err
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    finally:
        (corpus / "train.txt").write_text(text)
    rc, _, err = run_launch(prepare_args(corpus, out), capsys)   # the same text again (new times): resumes
    assert rc == 0, err
    assert (out / "train" / "shard-00001.array_record").read_bytes() == \
        (done / "train" / "shard-00001.array_record").read_bytes()


def test_a_corpus_reached_through_links_keeps_its_stamps_and_a_nested_prepared_folder(tmp_path):
    """Keeping link names (for the split) must not change what a corpus is known by: a run or prepare on a linked
    corpus resumed only while its stamps were the target's. A prepared folder inside the corpus folder is refused
    only where data.path reads recursively (a folder or plain glob never reads below itself)."""
    import ml_collections  # pylint: disable=import-outside-toplevel
    from tupe_jax.data import stamps  # pylint: disable=import-outside-toplevel
    raw = write_corpus(tmp_path / "raw", docs=8)
    os.symlink(raw, tmp_path / "linked")
    via_link = sources.find_files(str(tmp_path / "linked"))
    assert stamps.file_stamps(via_link, str(tmp_path / "linked")) == \
        stamps.file_stamps([f.resolve() for f in via_link], str(tmp_path / "linked"))
    assert stamps.legacy_file_stamps(via_link) == stamps.legacy_file_stamps([f.resolve() for f in via_link])

    def config(path, cache=tmp_path / "cache"):
        return ml_collections.ConfigDict({"data": {"name": "text_files", "path": path, "file_pattern": "",
                                                   "cache_dir": str(cache)}})
    for path in (str(raw), str(raw / "*.txt"), str(raw / "train.txt")):
        sources.refuse_inside_corpus(config(path), str(raw / "prepared"), "--workdir", "prepare into")
    with pytest.raises(UserError, match="is inside the folder data.path .* reads recursively"):
        sources.refuse_inside_corpus(config(str(raw) + "/**/*.txt"), str(raw / "prepared"), "--workdir", "prepare into")
    with pytest.raises(UserError, match=r"cache is inside .*, --config.data.cache_dir, give a data cache outside it"):
        sources.refuse_inside_corpus(config(str(raw) + "/**/*.txt", raw / "cache"), str(tmp_path / "run"), "--w", "x")
    sources.refuse_inside_corpus(config(str(raw) + "/**/*.txt"), str(tmp_path / "prepared"), "--workdir", "x")
    with pytest.raises(UserError, match="reads recursively"):        # a wildcard inside a name: its folder is read
        sources.refuse_inside_corpus(config(str(tmp_path) + "/r*w/**/*.txt"), str(raw / "run"), "--workdir", "x")
    assert not (tmp_path / "cache").exists()                   # the check makes no folder


def test_a_run_inside_a_recursively_read_corpus_is_refused_and_leaves_no_folder(tmp_path, capsys):
    """`pretrain` into runs/x under a `**` data.path trained on, and its final evaluation then read, its own
    tokenizer/vocab.txt and checkpoint markers as corpus text; a resume was refused as other data. Refused before
    anything is written, the folders `mkdir -p` would have made included."""
    raw = write_corpus(tmp_path / "raw", docs=8)
    before = sorted(p.name for p in raw.rglob("*"))
    rc = launch.main(["pretrain", "--config=configs/pretrain.py:pe=bert_a,size=tiny", f"--workdir={raw}/runs/a/x",
                      "--config.train.steps=2", "--config.data.name=text_files", f"--config.data.path={raw}/**/*.txt",
                      f"--config.data.cache_dir={tmp_path / 'cache'}"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{raw}/runs/a/x is inside the folder data.path" in err and ", --workdir, train into" in err
    assert sorted(p.name for p in raw.rglob("*")) == before


@pytest.mark.parametrize("objective,key", [("clm", "packing=full_sentences"), ("mlm", "mask_prob=0.3"),
                                           ("clm", "max_predictions=5")])
def test_keys_prepare_does_not_read_are_refused(tmp_path, capsys, objective, key):
    """A causal prepare given data.packing=full_sentences wrote it into config.json while its manifest said
    contiguous; masking keys, which pretraining applies as it reads, were taken and did nothing."""
    corpus = write_corpus(tmp_path / "raw", docs=8)
    rc, _, err = run_launch(prepare_args(corpus, tmp_path / "out", f"--config.data.{key}", objective=objective), capsys)
    assert rc == 2 and f"prepare does not read data.{key.split('=')[0]}" in err and not (tmp_path / "out").exists()
