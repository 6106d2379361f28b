"""A checkpoint that does not read, met by a read-only command (evaluate, export, the analyses, init_from: they all
read through `workdir.load_run` / `checkpoint.restore_params` / `read_meta`): one line naming the step, the root of
the failure and the other steps; no other step read in its place; nothing on disk changed. And `failed_reads`: the
root-cause line, and the hook that keeps a failed read's leftovers off stderr (resuming training past such a step,
and the same through real processes: test_reliability.py)."""
import asyncio
import glob
import logging
import os
import shutil
import sys
import types

import pytest

from glue_fixtures import make_pretrained
from tests.workdir_fixtures import tree
from tupe_jax import checkpoint as ckpt
from tupe_jax import failed_reads
from tupe_jax import workdir as workdir_lib
from tupe_jax.errors import UserError
from tupe_jax.workdir.meta import latest_meta


def _truncate_largest(step_dir):
    names = [f for f in glob.glob(os.path.join(step_dir, "state", "**", "*"), recursive=True) if os.path.isfile(f)]
    biggest = max(names, key=os.path.getsize)
    with open(biggest, "r+b") as f:
        f.truncate(os.path.getsize(biggest) // 2)


def _garbage(path):
    with open(path, "wb") as f:
        f.write(b"\x00{not json")


DAMAGE = {   # what each leaves unreadable for a read-only command
    "truncated_array_file": _truncate_largest,
    "garbage_state_metadata": lambda d: _garbage(os.path.join(d, "state", "_METADATA")),
    "garbage_meta": lambda d: _garbage(os.path.join(d, "meta", "metadata")),
    "missing_manifest": lambda d: os.remove(os.path.join(d, "state", "manifest.ocdbt")),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny pretraining run with checkpoints at steps 5 and 10 (the same params)."""
    root = tmp_path_factory.mktemp("failed_reads")
    wd = root / "run"
    make_pretrained(str(wd), str(root / "cache"), steps=(5, 10))
    return wd


def _damaged(run, tmp_path, kind):
    wd = tmp_path / "run"
    shutil.copytree(run, wd)
    DAMAGE[kind](str(wd / "checkpoints" / "10"))
    return str(wd)


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_read_only_command_names_the_step_that_does_not_read_and_reads_no_other(kind, run, tmp_path):
    wd = _damaged(run, tmp_path, kind)
    before = tree(wd)
    for step in (None, 10):          # the newest, or asked for by number: the same line, never step 5 instead
        with pytest.raises(UserError) as info:
            workdir_lib.load_run(wd, step)
        message = str(info.value)
        assert message.startswith(f"error: checkpoint step 10 in {wd}/checkpoints failed to restore (")
        assert "\n" not in message and message.endswith(", --step, ask for another step (5) or check the files")
    assert workdir_lib.load_run(wd, 5).step == 5
    assert tree(wd) == before


@pytest.mark.filterwarnings("ignore:Sharding info not provided")   # the whole state, read without a target
def test_init_from_names_its_own_flag(run, tmp_path):
    wd = _damaged(run, tmp_path, "missing_manifest")
    with pytest.raises(UserError, match=r"failed to restore \(ValueError: NOT_FOUND: .*, --config\.init_step, ask"):
        ckpt.restore_params(wd, 10, where="--config.init_step")
    with pytest.raises(UserError, match=r"\(JSONDecodeError: .*, --config\.init_step, ask for another step \(5\)"):
        workdir_lib.read_meta(_damaged(run, tmp_path / "meta", "garbage_meta"), 10, "--config.init_step")


def test_the_run_checks_read_the_newest_meta_that_reads(run, tmp_path, caplog):
    """The gate of a resume (`latest_meta`) names a newer step whose meta does not read and checks the one before,
    as the resume itself then restores it."""
    wd = _damaged(run, tmp_path, "garbage_meta")
    with caplog.at_level(logging.WARNING):
        step, meta = latest_meta(wd)
    assert step == 5 and meta["param_shapes"]
    assert "checkpoint step 10" in caplog.text and "JSONDecodeError" in caplog.text


# ------------------------------------------------------------------------------------------------ failed_reads
def test_describe_names_the_root_of_the_cause_chain():
    try:
        try:
            raise ValueError("OUT_OF_RANGE: Error reading \"w/0.0\"\nmore detail")
        except ValueError as inner:
            raise Exception("Encountered error while reading array index: (slice(0, 2, 1),)") from inner
    except Exception as err:  # pylint: disable=broad-except
        assert failed_reads.describe(err) == "ValueError: OUT_OF_RANGE: Error reading \"w/0.0\""
        assert failed_reads.describe(err, limit=9) == "ValueError: OUT_OF_RA"
    assert failed_reads.describe(KeyError()) == "KeyError"


def _unraisable(exc, obj=None, traceback=None):
    return types.SimpleNamespace(exc_type=type(exc), exc_value=exc, exc_traceback=traceback, err_msg=None,
                                 object=obj)


def _closed_loop_error():
    """The RuntimeError asyncio raises for a callback posted to a closed loop, with its real traceback."""
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as err:
        return err
    raise AssertionError("a closed loop took a callback")


def _coroutine_of(filename):
    namespace = {}
    exec(compile("async def read():\n    pass\n", filename, "exec"), namespace)  # pylint: disable=exec-used
    return namespace["read"]()


def test_only_a_failed_reads_leftovers_are_dropped(monkeypatch):
    closed = _closed_loop_error()
    orbax_coroutine, our_coroutine = _coroutine_of("/site/orbax/serialization.py"), _coroutine_of("/ours/reads.py")
    closed_by_gc = Exception("Encountered error while reading array index")
    closed_by_gc.__cause__ = GeneratorExit()
    try:
        assert failed_reads.is_leftover(_unraisable(closed, traceback=closed.__traceback__))
        assert not failed_reads.is_leftover(_unraisable(RuntimeError("Event loop is closed")))   # raised elsewhere
        assert not failed_reads.is_leftover(_unraisable(RuntimeError("boom"), traceback=closed.__traceback__))
        assert failed_reads.is_leftover(_unraisable(closed_by_gc, orbax_coroutine))
        assert not failed_reads.is_leftover(_unraisable(closed_by_gc, our_coroutine))
        assert not failed_reads.is_leftover(_unraisable(ValueError("a real bug"), orbax_coroutine))

        seen = []
        monkeypatch.setattr(sys, "unraisablehook", seen.append)
        monkeypatch.setitem(failed_reads._INSTALLED, "done", False)   # pylint: disable=protected-access
        monkeypatch.setattr(logging.getLogger("asyncio"), "filters", [])
        failed_reads.quiet_leftovers()
        failed_reads.quiet_leftovers()                                  # once only: not wrapped twice
        other = _unraisable(ValueError("a real bug"), orbax_coroutine)
        for args in (_unraisable(closed, traceback=closed.__traceback__), _unraisable(closed_by_gc, orbax_coroutine),
                     other):
            sys.unraisablehook(args)
        assert seen == [other]

        def record(exc):
            return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "Future exception was never retrieved\n"
                                     "future: <Future finished>", None, (type(exc), exc, exc.__traceback__))
        drop = next(f for f in logging.getLogger("asyncio").filters
                    if type(f).__name__ == "_DropUnretrieved")
        assert not drop.filter(record(ValueError("NOT_FOUND: x does not exist [tensorstore_spec='{}']")))
        assert not drop.filter(record(ValueError('OUT_OF_RANGE: Error reading "w/0.0" in OCDBT database at ...')))
        assert drop.filter(record(ValueError("a real bug")))
        other_message = record(ValueError("NOT_FOUND [tensorstore_spec='{}']"))
        other_message.msg = "Task was destroyed but it is pending!"
        assert drop.filter(other_message)
    finally:
        orbax_coroutine.close()
        our_coroutine.close()
