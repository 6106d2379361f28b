"""`launch prepare` (sharded ArrayRecord + manifest, resumable, refusals) and reading a prepared directory."""
import json
import os
import shutil

import ml_collections
import numpy as np
import pytest

import launch
from tupe_jax import data as D
from tupe_jax.data import prepare as P
from tupe_jax.data import pool
from tupe_jax.data import prepared as R
from tupe_jax.errors import UserError

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega red green blue cyan magenta yellow black white").split()


def write_corpus(folder, docs=240, seed=0):
    """train.txt / valid.txt in the BERT layout: one sentence per line, blank line between documents."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.txt", docs), ("valid.txt", docs // 8)):
        paras = ["\n".join(" ".join(rng.choice(WORDS, rng.integers(3, 14))) for _ in range(rng.integers(1, 5)))
                 for _ in range(n)]
        (folder / name).write_text("\n\n".join(paras) + "\n", encoding="utf-8")
    return folder


def prepare_args(corpus, out, *extra, max_len=32, objective="mlm"):
    """The prepare command line; an override in `extra` replaces the default one (a key may be given once)."""
    overrides = dict(a.split("=", 1) for a in ("--config.data.name=text_files", f"--config.data.path={corpus}",
                                               "--config.prepare.shard_mb=0.004", "--config.data.num_threads=2",
                                               *extra) if a.startswith("--config."))
    return ["prepare", f"--config=configs/prepare.py:objective={objective},max_len={max_len},vocab_size=200",
            f"--workdir={out}", *(f"{k}={v}" for k, v in overrides.items()),
            *(a for a in extra if not a.startswith("--config."))]


def run_launch(args, capsys):
    cwd = os.getcwd()
    os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        rc = launch.main(args)
    finally:
        os.chdir(cwd)
    return rc, capsys.readouterr().err.strip()


def listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else None


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prep")
    corpus = write_corpus(tmp / "corpus")
    out = tmp / "out"
    assert launch.main(prepare_args(corpus, out)) == 0
    return corpus, out


def run_config(out, objective="mlm", max_len=32):
    c = ml_collections.ConfigDict({"data": D.default_data_config(),
                                   "model": {"vocab_size": 200, "max_len": max_len, "objective": objective}})
    c.data.name, c.data.path, c.data.prefetch = "prepared", str(out), 0
    return c


def test_manifest_matches_shards_and_text(made):
    corpus, out = made
    m = json.loads((out / "manifest.json").read_text())
    train = m["splits"]["train"]
    assert set(m["splits"]) == {"train", "validation"} and len(train["shards"]) > 3
    assert train["examples"] == sum(s["examples"] for s in train["shards"])
    split = R.open_split(run_config(out), "train")
    assert split.n == train["examples"]
    # the records are the documents tokenized and packed shard by shard, exactly as `pack` does it
    tok = D.Tokenizer.from_file(out / "tokenizer" / "vocab.txt")
    c = ml_collections.ConfigDict({"data": {**D.default_data_config().to_dict(), "name": "text_files",
                                            "path": str(corpus)}})
    docs = list(P.documents(c, "train"))
    expect = [ex for g in pool.groups(iter(docs), int(0.004e6)) for ex in P.pack(g, tok, m["settings"])[0]]
    toks, valid = split.rows(np.arange(split.n), np.ones(split.n, bool), 31)
    assert len(expect) == split.n
    for i in (0, 1, split.n // 2, split.n - 1):
        np.testing.assert_array_equal(toks[i][valid[i]], expect[i])


def test_the_parallel_learner_gives_the_vocabulary_of_tokenizer_train(made):
    corpus, out = made
    c = ml_collections.ConfigDict({"data": {**D.default_data_config().to_dict(), "name": "text_files",
                                            "path": str(corpus)}})
    assert D.Tokenizer.from_file(out / "tokenizer" / "vocab.txt").vocab == \
        D.Tokenizer.train(P.documents(c, "train"), 200).vocab


def test_rerun_of_a_finished_directory_changes_nothing(made, capsys):
    corpus, out = made
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*.array_record")}
    rc, err = run_launch(prepare_args(corpus, out), capsys)
    assert rc == 0, err
    assert before == {p: p.stat().st_mtime_ns for p in out.rglob("*.array_record")}


def test_resume_writes_only_missing_shards(made, tmp_path, capsys):
    corpus, done = made
    out = tmp_path / "out"
    shutil.copytree(done, out)
    for name in ("manifest.json", "train/shard-00002.json", "train/shard-00002.array_record"):
        (out / name).unlink()                         # as a kill -9 leaves it: shard 2 never finished
    (out / "train" / ".shard-00003.array_record.99.tmp").write_bytes(b"half")   # a half-written record file
    kept = {p: p.stat().st_mtime_ns for p in out.rglob("*.array_record") if "00002" not in p.name}
    rc, err = run_launch(prepare_args(corpus, out, "--config.data.num_threads=1"), capsys)  # workers may change
    assert rc == 0, err
    assert kept == {p: p.stat().st_mtime_ns for p in kept}
    assert not list(out.rglob(".shard-*"))
    for name in ("train/shard-00002.array_record", "train/shard-00002.json"):
        assert (out / name).read_bytes() == (done / name).read_bytes()
    # the manifest says what the data is: byte-identical to the uninterrupted one's (it held the wall time and the
    # worker count, so no two prepares agreed)
    assert (out / "manifest.json").read_bytes() == (done / "manifest.json").read_bytes()


def test_bad_inputs_are_one_line_and_write_nothing(made, tmp_path, capsys):
    corpus, out = made
    # an empty corpus: refused before the directory exists
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "train.txt").write_text("\n\n  \n")
    rc, err = run_launch(prepare_args(empty, tmp_path / "e"), capsys)
    assert rc == 2 and err.startswith("error: ") and "no text" in err and "\n" not in err
    assert not (tmp_path / "e").exists()
    # the same directory with another sequence length / another tokenizer
    state = listing(out)
    rc, err = run_launch(prepare_args(corpus, out, max_len=64), capsys)
    assert rc == 2 and "model.max_len" in err and "\n" not in err and listing(out) == state
    other = D.Tokenizer(list(D.Tokenizer.from_file(out / "tokenizer" / "vocab.txt").vocab[:-5]))
    vocab = other.save(tmp_path / "vocab")
    rc, err = run_launch(prepare_args(corpus, out, f"--config.data.vocab_file={vocab}"), capsys)
    assert rc == 2 and "\n" not in err and listing(out) == state


def test_reading_refuses_other_settings_and_damaged_directories(made, tmp_path):
    _, done = made
    with pytest.raises(UserError, match="max_len=32 .this run: 64"):
        D.validate_config(run_config(done, max_len=64))
    with pytest.raises(UserError, match="objective='mlm'"):
        D.validate_config(run_config(done, objective="clm"))
    out = tmp_path / "out"
    shutil.copytree(done, out)
    (out / "train" / "shard-00001.array_record").unlink()
    with pytest.raises(UserError, match="shard shard-00001.array_record of train is missing"):
        D.validate_config(run_config(out))
    shutil.copy(done / "validation" / "shard-00000.array_record", out / "train" / "shard-00001.array_record")
    with pytest.raises(UserError, match="but the manifest says"):
        D.validate_config(run_config(out))
    (out / "manifest.json").unlink()
    with pytest.raises(UserError, match="holds no manifest.json"):
        D.validate_config(run_config(out))


def iterator(out, p=0, pc=1, objective="mlm", **kw):
    c = run_config(out, objective)
    tok = D.get_tokenizer(c, None)
    return D.pretrain_iterator(c, tok, split="train", global_batch_size=8, seed=3, process_index=p,
                               process_count=pc, **kw)


@pytest.mark.parametrize("objective", ["mlm", "clm"])
def test_each_process_reads_only_its_rows_and_the_union_is_the_global_batch(made, objective, tmp_path):
    corpus, out = made
    if objective == "clm":
        out = tmp_path / "clm"
        assert launch.main(prepare_args(corpus, out, objective="clm")) == 0
    whole = iterator(out, objective=objective)
    parts = [iterator(out, p, 2, objective=objective) for p in range(2)]
    for step in range(6):
        for it in parts:
            it.batcher.source.reads = []
        g = next(whole).present()
        for p, it in enumerate(parts):
            b = next(it).present()
            for k in g:
                np.testing.assert_array_equal(b[k], g[k][p::2], err_msg=f"{k} step {step} process {p}")
            rows, _ = it.batcher.examples(step)
            assert sorted(it.batcher.source.reads) == sorted(rows[rows >= 0].tolist())
        assert not set(parts[0].batcher.examples(step)[0]) & set(parts[1].batcher.examples(step)[0])


def test_resume_and_batch_is_a_function_of_seed_and_step(made):
    _, out = made
    first = iterator(out)
    for _ in range(3):
        next(first)
    state = json.loads(json.dumps(first.get_state()))
    expected = [next(first).present() for _ in range(30)]   # crosses an epoch boundary (~40 examples/shard)
    fresh = iterator(out)
    fresh.set_state(state)
    for e in expected:
        got = next(fresh).present()
        for k in e:
            np.testing.assert_array_equal(got[k], e[k])
    again = iterator(out, p=0, pc=1)
    got = [next(again).present() for _ in range(4)][3]
    for k in got:
        np.testing.assert_array_equal(got[k], expected[0][k])


def test_pretrain_on_a_damaged_directory_is_one_line_and_leaves_no_run(made, tmp_path, capsys):
    _, done = made
    out = tmp_path / "out"
    shutil.copytree(done, out)
    (out / "validation" / "shard-00000.array_record").unlink()
    (out / "train" / "shard-00000.array_record").unlink()
    rc, err = run_launch(["pretrain", "--config=configs/pretrain.py:pe=tupe_r", f"--workdir={tmp_path / 'run'}",
                          "--config.data.name=prepared", f"--config.data.path={out}", "--config.model.max_len=32",
                          "--config.model.vocab_size=200"], capsys)
    assert rc == 2 and err.startswith("error: shard shard-00000.array_record of train is missing") and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_a_run_refuses_a_directory_with_another_tokenizer(made, tmp_path):
    _, done = made
    c = run_config(done)
    other = D.Tokenizer(list(D.Tokenizer.from_file(done / "tokenizer" / "vocab.txt").vocab[:-5]))
    other.save(tmp_path / "run" / "tokenizer")          # the run was started on another prepared directory
    with pytest.raises(UserError, match="is not the tokenizer .* was prepared with"):
        D.get_tokenizer(c, tmp_path / "run")
    assert D.get_tokenizer(c, tmp_path / "fresh").vocab == D.Tokenizer.from_file(done / "tokenizer" / "vocab.txt").vocab
    assert (tmp_path / "fresh" / "tokenizer" / "vocab.txt").is_file()


def test_only_process_0_copies_the_directory_tokenizer(made, tmp_path, monkeypatch):
    import jax
    _, done = made
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert D.get_tokenizer(run_config(done), tmp_path / "run").vocab == \
        D.Tokenizer.from_file(done / "tokenizer" / "vocab.txt").vocab
    assert not (tmp_path / "run").exists()


def test_a_shard_from_other_settings_is_refused_on_resume(made, tmp_path, capsys):
    corpus, done = made
    out = tmp_path / "out"
    shutil.copytree(done, out)
    (out / "manifest.json").unlink()
    side = out / "train" / "shard-00001.json"
    side.write_text(json.dumps({**json.loads(side.read_text()), "settings": "another"}))
    state = listing(out)
    rc, err = run_launch(prepare_args(corpus, out), capsys)
    assert rc == 2 and "shard-00001.json was written with other settings" in err and "\n" not in err
    assert listing(out) == state


@pytest.mark.slow
def test_kill_9_or_sigterm_during_prepare_then_rerun_gives_the_uninterrupted_result(tmp_path):
    import signal
    import subprocess
    import sys
    import time
    corpus = write_corpus(tmp_path / "corpus", docs=3000)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = lambda out: [sys.executable, "-m", "launch"] + prepare_args(   # noqa: E731
        corpus, out, "--config.prepare.shard_mb=0.002", "--config.data.vocab_file=" + str(tmp_path / "v/vocab.txt"))
    D.Tokenizer.train((corpus / "train.txt").read_text().split("\n\n"), 200).save(tmp_path / "v")
    assert subprocess.run(args(tmp_path / "straight"), cwd=root, capture_output=True).returncode == 0
    proc = subprocess.Popen(args(tmp_path / "killed"), cwd=root, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    train = tmp_path / "killed" / "train"
    while proc.poll() is None and not (train.is_dir() and len(list(train.glob("*.json"))) >= 3):
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed" / "manifest.json").exists(), "prepare finished before it was killed"
    assert subprocess.run(args(tmp_path / "killed"), cwd=root, capture_output=True).returncode == 0
    a, b = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("straight", "killed"))
    assert a["splits"] == b["splits"]   # per-shard counts, sizes and sha256: the same bytes
    # SIGTERM (a preempted VM's notice): it ended the process with no word, its workers left running and the pool's
    # semaphores leaked; now the workers are ended, one line says how to continue, and the rerun finishes the same
    proc = subprocess.Popen(args(tmp_path / "termed"), cwd=root, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    train = tmp_path / "termed" / "train"
    while proc.poll() is None and not (train.is_dir() and len(list(train.glob("*.json"))) >= 3):
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().splitlines()[-1].startswith("error: interrupted"), err[-2000:]
    assert "leaked semaphore" not in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "termed" / "manifest.json").exists()
    deadline = time.time() + 20   # the pool's workers and multiprocessing's resource tracker end; none may stay
    while (left := subprocess.run(["ps", "-o", "pid=,args=", "-s", str(proc.pid)], capture_output=True,
                                  text=True).stdout.strip()) and time.time() < deadline:
        time.sleep(0.5)
    assert not left, left
    assert subprocess.run(args(tmp_path / "termed"), cwd=root, capture_output=True).returncode == 0
    c = json.loads((tmp_path / "termed" / "manifest.json").read_text())
    assert a["splits"] == c["splits"]


def test_an_empty_validation_split_is_refused_before_anything_is_written(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", docs=40)
    (corpus / "valid.txt").write_text("\n \n")
    rc, err = run_launch(prepare_args(corpus, tmp_path / "out"), capsys)
    assert rc == 2 and "the validation split of data.name=text_files has no text" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_an_import_fairseq_tokenizer_prepares_with_its_own_bpe(tmp_path):
    """`data.vocab_file` = an import-fairseq run's tokenizer/vocab.txt: the workers tokenize with that run's fairseq
    BPE (they used to rebuild a WordPiece tokenizer from its vocabulary list, so every id was another's), and a run
    on the directory reads the same tokenizer back."""
    pytest.importorskip("sacremoses", reason="the fairseq extra brings sacremoses")
    pytest.importorskip("subword_nmt", reason=".[test] brings subword-nmt")
    from tests import fairseq_fixtures as F  # pylint: disable=import-outside-toplevel
    from tupe_jax.data.fairseq_bpe import FairseqBpeTokenizer, read_dictionary  # pylint: disable=import-outside-toplevel
    corpus = write_corpus(tmp_path / "corpus")
    lines = [x for x in (corpus / "train.txt").read_text(encoding="utf-8").splitlines() if x.strip()]
    codes = F.learn_codes(lines, merges=60)
    tok = FairseqBpeTokenizer(read_dictionary(F.make_dict(lines, codes)), codes)
    tok.save(str(tmp_path / "fairseq-run" / "tokenizer"))
    out = tmp_path / "out"
    args = prepare_args(corpus, out, f"--config.data.vocab_file={tmp_path / 'fairseq-run' / 'tokenizer' / 'vocab.txt'}")
    args[1] = args[1].replace("vocab_size=200", f"vocab_size={tok.vocab_size}")
    assert launch.main(args) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["settings"]["tokenizer"] == tok.fingerprint
    c = run_config(out)
    c.model.vocab_size = tok.vocab_size
    assert isinstance(R.prepared_tokenizer(c, None), FairseqBpeTokenizer)
    split = R.open_split(c, "train")
    docs = list(P.documents(ml_collections.ConfigDict(
        {"data": {**D.default_data_config().to_dict(), "name": "text_files", "path": str(corpus)}}), "train"))
    expect = [ex for g in pool.groups(iter(docs), int(0.004e6)) for ex in P.pack(g, tok, m["settings"])[0]]
    toks, valid = split.rows(np.arange(split.n), np.ones(split.n, bool), 31)
    assert len(expect) == split.n
    for i in range(split.n):
        np.testing.assert_array_equal(toks[i][valid[i]], expect[i])


def test_a_worker_that_cannot_load_the_tokenizer_fails_its_shard_instead_of_hanging(tmp_path):
    """multiprocessing.Pool replaces a worker whose initializer raised, forever, so `prepare` would hang: the
    initializer keeps the error and the worker's first shard raises it (in-process here)."""
    P._init_worker(str(tmp_path / "nowhere" / "vocab.txt"), "sha256:x", {})   # returns: no exception escapes
    with pytest.raises(RuntimeError, match=r"a prepare worker could not load .*nowhere/vocab.txt: UserError: "):
        P._write_shard((str(tmp_path), 0, ["some text"]))
    P._WORKER.clear()
