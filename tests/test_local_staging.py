"""tupe_jax/local_staging.py: a bucket writer's local staging folder, removed by the next one after a kill -9."""
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from tupe_jax import local_staging

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOLD = ("import sys, time; sys.path.insert(0, sys.argv[1]); from tupe_jax import local_staging; "
        "p = local_staging.make(sys.argv[2]); open(p + '/events', 'w').write('x'); print(p, flush=True); "
        "time.sleep(600)")


@pytest.fixture
def tmp_root(tmp_path, monkeypatch):
    """The temporary folder of this test and of the processes it starts."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    return tmp_path


def holder(kind: str):
    """A process that made a `kind` staging folder with a file in it and sleeps; (process, folder)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, ROOT, kind], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_a_killed_processs_folder_is_removed_by_the_next_make_and_a_live_ones_is_kept(tmp_root):
    killed, killed_folder = holder("tb")
    live, live_folder = holder("tb")
    other_kind, other_folder = holder("analysis")
    older = tmp_root / "tupe-jax-tb-older"           # made before owner files: whose it is cannot be told
    older.mkdir()
    try:
        for proc in (killed, other_kind):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert os.path.isdir(killed_folder) and os.path.isfile(killed_folder + ".owner")   # nothing removed it
        mine = local_staging.make("tb")
        assert not os.path.exists(killed_folder) and not os.path.exists(killed_folder + ".owner")
        assert os.listdir(live_folder) == ["events"] and os.path.isfile(live_folder + ".owner")
        assert os.listdir(other_folder) == ["events"]        # another kind: its own writers sweep it
        assert older.is_dir()
        assert os.path.dirname(mine) == str(tmp_root) and os.path.basename(mine).startswith("tupe-jax-tb-")
        assert os.listdir(mine) == []                         # only what is staged gets uploaded
        again = local_staging.make("tb")                      # this process's own folder is held too
        assert os.path.isdir(mine) and again != mine
        for folder in (mine, again):
            local_staging.remove(folder)
            assert not os.path.exists(folder) and not os.path.exists(folder + ".owner")
        assert local_staging.sweep("analysis") == [other_folder]
        assert not os.path.exists(other_folder + ".owner")
    finally:
        for proc in (killed, live, other_kind):
            proc.kill()
            proc.wait()
    assert local_staging.sweep("tb") == [live_folder]         # ended now, however it ended
    assert sorted(os.listdir(tmp_root)) == ["tupe-jax-tb-older"]


def test_remove_of_a_folder_make_did_not_give_only_removes_it(tmp_root):
    folder = tmp_root / "plain"
    (folder / "sub").mkdir(parents=True)
    local_staging.remove(str(folder))
    local_staging.remove(str(folder))                         # gone already: nothing to do
    assert os.listdir(tmp_root) == []
