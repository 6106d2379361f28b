"""What a failed command leaves in a bucket run folder (`workdir/undo.py`), against the emulator of gcs_fixtures:
finished sub-runs of a sweep or a suite are kept, as in a local folder."""
import pytest

from tests.gcs_fixtures import BUCKET
from tests.workdir_fixtures import load_config
from tupe_jax import files
from tupe_jax import workdir as workdir_lib


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
        assert not files.exists(f"{wd}/.lock")
