"""What a failed command leaves in a bucket run folder (`workdir/undo.py`), against the emulator of gcs_fixtures:
finished sub-runs of a sweep or a suite are kept, as in a local folder, and a half-written checkpoint step (in a
bucket a `<step>/` without Orbax's commit file) is no step."""
import pytest

from tests.gcs_fixtures import BUCKET
from tests.workdir_fixtures import fake_checkpoint, load_config
from tupe_jax import checkpoint as ckpt
from tupe_jax import files
from tupe_jax import workdir as workdir_lib
from tupe_jax.workdir.claim import view


def test_a_failed_sweep_in_a_bucket_keeps_the_runs_it_finished(gcs):
    """A glue-sweep or compare suite whose second run failed emptied its bucket folder: only the names of the new
    entries were looked at (`lr_1` is neither a results file nor `checkpoints`), not what lies below them."""
    for kept in ("lr_1/results.json", "lr_1/checkpoints/3/commit_success.txt"):
        wd = f"gs://{BUCKET}/failed-sweep-{kept.count('/')}"
        with pytest.raises(RuntimeError):
            with workdir_lib.claim(wd, load_config()):
                files.write_text(f"{wd}/{kept}", "")
                files.write_text(f"{wd}/lr_2/metrics.jsonl", "{}\n")
                raise RuntimeError("the second run diverged")
        assert files.isfile(f"{wd}/{kept}") and files.isfile(f"{wd}/config.json")
        assert files.read_object(f"{wd}/.lock") == ("", 0)      # the lease released


def test_a_half_written_step_in_a_bucket_is_no_step_and_a_writer_removes_it(gcs, capsys):
    """In a bucket Orbax writes straight into `<step>/` and adds commit_success.txt last: a save that failed or was
    killed half-way left a `<step>/` that the folder checks counted as a step (kept a failed command's config,
    `view` saw 2 steps where Orbax listed 1) and that no writer removed."""
    wd = f"gs://{BUCKET}/half-written"
    with workdir_lib.claim(wd, load_config()):
        fake_checkpoint(wd, load_config(), 3)
    config = files.read_text(f"{wd}/config.json")
    with pytest.raises(RuntimeError):
        with workdir_lib.claim(wd, load_config(**{"checkpoint.every": 50})):
            files.write_text(f"{wd}/checkpoints/6/state/_METADATA", "{}")
            raise RuntimeError("the storage failed during the save of step 6")
    assert files.read_text(f"{wd}/config.json") == config          # it produced nothing: put back
    assert view(wd) == "config.json, checkpoints/ with 1 steps (newest 3)"
    ckpt.Checkpointer(wd, async_=False).close()                      # a writer: a resume's
    assert files.listdir(f"{wd}/checkpoints") == ["3"] and workdir_lib.checkpoint_steps(wd) == [3]
    assert f"{wd}/checkpoints: removed 6, a save that a stopped run did not finish" in capsys.readouterr().out
