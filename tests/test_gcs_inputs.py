"""Bucket paths as inputs, against the GCS emulator of gcs_fixtures: an object read while another writer rewrites
it is one whole version; a malformed path (an empty or invalid bucket name, `//`, a glob) is one line before anything
is read or written; the local copy of a bucket corpus follows the bucket (an object rewritten at the same size, an
object deleted); prepared corpora are local (`prepare` into a bucket and `data.path=gs://...` for one are refused),
while a bucket run on a local prepared corpus keeps its tokenizer in the bucket."""
import itertools
import json
import os
import threading

import pytest

from tests.gcs_fixtures import BUCKET, tiny
from tupe_jax import files
from tupe_jax.data import cache as data_cache
from tupe_jax.errors import UserError


@pytest.mark.parametrize("path, needle", [
    ("gs://", "'' is not a bucket name"), ("gs:///run", "'' is not a bucket name"),
    ("gs://ab/run", "'ab' is not a bucket name"), ("gs://Upper/run", "'Upper' is not a bucket name"),
    (f"gs://{BUCKET}//run", "has an empty folder name (//)"), (f"gs://{BUCKET}/a//b", "empty folder name"),
    (f"gs://{BUCKET}/txt/*.txt", "is a pattern"), ("s3://bucket/run", "is not a gs:// path")])
def test_a_malformed_bucket_path_is_one_line_naming_the_flag(gcs, path, needle):
    with pytest.raises(UserError, match=r"^error: .*" + needle.replace("(", r"\(").replace(")", r"\)")
                       .replace("*", r"\*") + r".*, --where, "):
        files.check_bucket(path, "--where")
    files.check_bucket(f"gs://{BUCKET}/run/", "--where")         # a trailing slash is fine


def test_a_bucket_object_read_while_another_writer_rewrites_it_is_one_whole_version(gcs):
    """A lease's heartbeat or a live run's metrics flush rewrites an object while another command reads it. A read
    that asked for the size and then for that many bytes got part of a longer or shorter version (most reads here
    were torn, and a lease test failed on one); `files.read_text` returns one version whole."""
    path = f"gs://{BUCKET}/rewritten/.lock"
    versions = [json.dumps({"pid": 1, "heartbeat": "x" * n}) for n in (1, 40, 7, 90, 3)]
    files.write_text(path, versions[0])
    stop = threading.Event()

    def rewrite():
        for i in itertools.count():
            if stop.is_set():
                return
            files.write_text(path, versions[i % len(versions)])
    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        read = [files.read_text(path) for _ in range(200)]
    finally:
        stop.set()
        writer.join()
    assert set(read) <= set(versions), [r for r in read if r not in versions][:3]
    assert len(set(read)) > 1                                     # the writer did rewrite it during the reads
    with pytest.raises(FileNotFoundError, match=f"^gs://{BUCKET}/rewritten/none$"):
        files.read_text(f"gs://{BUCKET}/rewritten/none")


def test_the_local_copy_of_a_bucket_corpus_follows_the_bucket(gcs, tmp_path):
    """A rewrite of the same size was not fetched again (the copy kept the old text), and an object deleted from the
    bucket was still read from the copy."""
    folder = f"gs://{BUCKET}/mirrored"
    files.write_text(f"{folder}/a.txt", "the cat sat on the mat\n")
    files.write_text(f"{folder}/b.txt", "a dog ran\n")
    config = tiny(tmp_path / "cache")
    local = data_cache.local_input(config, folder, "--config.data.path")
    assert sorted(n for n in os.listdir(local) if not n.startswith(".")) == ["a.txt", "b.txt"]
    files.write_text(f"{folder}/a.txt", "the bat hit on the hat\n")   # same size, other text
    files.remove(f"{folder}/b.txt")
    local = data_cache.local_input(config, folder, "--config.data.path")
    assert open(os.path.join(local, "a.txt"), encoding="utf-8").read() == "the bat hit on the hat\n"
    assert sorted(n for n in os.listdir(local) if not n.startswith(".")) == ["a.txt"]


def test_prepared_corpora_are_local_and_a_bucket_run_keeps_its_tokenizer_in_the_bucket(gcs, tmp_path, monkeypatch):
    import launch  # pylint: disable=import-outside-toplevel
    from tupe_jax import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
    from tupe_jax.data import prepared  # pylint: disable=import-outside-toplevel
    from tupe_jax.pretrain import loop as pretrain_loop  # pylint: disable=import-outside-toplevel
    monkeypatch.chdir(tmp_path)                                   # a local ./gs:/ folder would show up here
    args = ["prepare", f"--config={os.path.dirname(os.path.dirname(__file__))}/configs/prepare.py:max_len=32,"
            "vocab_size=512", "--config.data.name=embedded", f"--config.data.cache_dir={tmp_path / 'cache'}"]
    assert launch.main([*args, f"--workdir=gs://{BUCKET}/prepared"]) == 2
    assert not files.exists(f"gs://{BUCKET}/prepared") and not os.path.exists("gs:")
    assert launch.main([*args, f"--workdir={tmp_path / 'prepared'}"]) == 0
    config = tiny(tmp_path / "cache")
    with config.unlocked():
        config.data.name, config.data.path = "prepared", f"gs://{BUCKET}/prepared"
    with pytest.raises(UserError, match="is a bucket path; a prepared directory is read from a local folder"):
        prepared.root_of(config)
    config.data.path = str(tmp_path / "prepared")
    remote = f"gs://{BUCKET}/run-on-prepared"
    pretrain_loop.pretrain(config, remote)
    assert files.isfile(f"{remote}/tokenizer/vocab.txt") and not os.path.exists("gs:")
    assert workdir_lib.load_run(remote).step == 6                 # evaluate/export find the run's tokenizer
