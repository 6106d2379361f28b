"""Decisions taken before a collective call are taken by every process together: a process that skipped the call
(a file its host lacks) would leave the others waiting in it."""
import numpy as np


def test_a_test_split_missing_on_another_host_is_skipped_on_every_host(monkeypatch):
    """predict is a collective call: a host whose GLUE copy lacks test.tsv skipped it while the others waited in
    the prediction for it (a hang). Every process now skips what any process lacks."""
    import jax  # pylint: disable=import-outside-toplevel
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    from tupe_jax.finetune import runner  # pylint: disable=import-outside-toplevel
    assert runner.on_every_process(True) and not runner.on_every_process(False)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    gathered = []
    monkeypatch.setattr(multihost_utils, "process_allgather",
                        lambda x: gathered.append(x) or np.asarray([[x[0]], [0]]))   # the other host lacks it
    assert not runner.on_every_process(True) and gathered[0].tolist() == [1]
