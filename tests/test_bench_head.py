"""benchmarks/bench_head.py: the torch head computes what ours does, torch's time over ours per round, refusals."""
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_head import D, TORCH, V, leaves, torch_over, variants  # noqa: E402  pylint: disable=wrong-import-position


def test_the_torch_head_gives_our_loss_and_gradients():
    """HF's head maths in torch against `head._plain` (and our chunks) on 24 rows: the benchmark's check, here so
    that a change to either side fails the suite before a timing run."""
    import jax  # pylint: disable=import-outside-toplevel
    pytest.importorskip("torch")
    fns = variants(24, [8], torch=True)
    assert list(fns) == ["plain", "chunks=8", TORCH]
    k = jax.random.split(jax.random.PRNGKey(1), 3)
    inputs = (jax.random.normal(k[0], (24, D)), jax.random.normal(k[1], (V, D)) * 0.05,
              jax.random.normal(k[2], (V,)) * 0.1)
    want = leaves(fns["plain"](*inputs))
    assert want[0] > 0 and [w.shape for w in want] == [(), (24, D), (V, D), (V,)]
    for name in ("chunks=8", TORCH):
        got = leaves(fns[name](*inputs))
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(w))), err_msg=name)
    again = leaves(fns[TORCH](*inputs))        # gradients are not accumulated across calls
    np.testing.assert_array_equal(again[2], leaves(fns[TORCH](*inputs))[2])
    np.testing.assert_allclose(again[2], want[2], rtol=1e-5, atol=1e-6 * float(np.max(np.abs(want[2]))))
    other = (inputs[0] * 2.0, inputs[1], inputs[2])   # new arrays: computed on them, not on the first call's
    for g, w in zip(leaves(fns[TORCH](*other)), leaves(fns["plain"](*other))):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(w))), err_msg="new inputs")


def test_torch_over_ours_is_taken_within_each_round():
    times = {"plain": [100.0, 200.0, 100.0, 50.0, 100.0, 100.0],
             "chunks=256": [50.0, 100.0, 100.0, 100.0, 100.0, 100.0],
             TORCH: [110.0, 200.0, 120.0, 60.0, 90.0, 130.0]}       # over plain: 1.1, 1, 1.2, 1.2, 0.9, 1.3
    r = torch_over(times)
    assert list(r) == ["plain", "chunks=256"]
    assert r["plain"]["median"] == pytest.approx(1.15) and (r["plain"]["min"], r["plain"]["max"]) == (0.9, 1.3)
    assert r["chunks=256"]["per_round"] == pytest.approx([2.2, 2.0, 1.2, 0.6, 0.9, 1.3])


def test_a_json_path_without_a_folder_is_refused_before_any_compute(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_head.py"), "--torch",
                           "--json", "/no/such/folder/x.json"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120, check=False)
    err = done.stderr.strip()
    assert done.returncode != 0 and err.startswith("error: no folder for --json") and len(err.splitlines()) == 1
    assert not list(tmp_path.iterdir())
