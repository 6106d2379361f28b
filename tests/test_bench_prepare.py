"""benchmarks/bench_prepare.py's scratch corpora: one text's copies are never reused for another text (or the same
file edited), and a copy cut off midway is not taken for a whole corpus by the next run."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_prepare  # noqa: E402  pylint: disable=wrong-import-position


def test_each_text_gets_its_own_scratch_folder(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("alpha text\n")
    b.write_text("beta text\n")
    scratch = tmp_path / "scratch"
    first = bench_prepare.text_scratch(scratch, a)
    assert first == bench_prepare.text_scratch(scratch, a) != bench_prepare.text_scratch(scratch, b)
    copies = bench_prepare.corpus(first, a, 2)
    assert sorted(os.listdir(copies)) == ["wiki-000.train.txt", "wiki-001.train.txt"]
    assert (copies / "wiki-001.train.txt").read_text() == "alpha text\n"
    other = bench_prepare.corpus(bench_prepare.text_scratch(scratch, b), b, 2)   # the same count, another text
    assert (other / "wiki-000.train.txt").read_text() == "beta text\n"
    a.write_text("alpha text, edited\n")
    assert bench_prepare.text_scratch(scratch, a) != first


def test_a_copy_cut_off_midway_leaves_no_corpus_behind(tmp_path, monkeypatch):
    text = tmp_path / "a.txt"
    text.write_text("alpha text\n")
    scratch = tmp_path / "scratch"

    def disk_full(src, dst):
        raise OSError("no space left on device")

    monkeypatch.setattr(bench_prepare.os, "link", disk_full)
    with pytest.raises(OSError, match="no space"):
        bench_prepare.corpus(scratch, text, 3)
    assert os.listdir(scratch) == []                # c3 was taken for a whole 3-copy corpus by the next run
    monkeypatch.undo()
    assert len(os.listdir(bench_prepare.corpus(scratch, text, 3))) == 3
