"""Pretraining loop: loss falls for every scheme, sharding-invariant losses, exact resume, preemption."""
import os
import platform
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from configs import pretrain as pretrain_config
from tests import xla_flags
from tupe_jax import config as config_lib
from tupe_jax import workdir as workdir_lib
from tupe_jax import xla_options
from tupe_jax.errors import UserError
from tupe_jax.pretrain import evaluate as evaluate_lib
from tupe_jax.pretrain import loop as pretrain_loop
from tupe_jax.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_overrides(steps=20, **extra):
    base = {"model.hidden_size": "32", "model.num_layers": "2", "model.num_heads": "2", "model.mlp_dim": "64",
            "model.vocab_size": "512", "model.max_len": "32", "train.steps": str(steps), "train.batch_size": "16",
            "train.learning_rate": "3e-3", "train.warmup_steps": "5", "train.log_every": "1",
            "train.eval_every": "0", "train.eval_steps": "2", "checkpoint.every": "1000",
            "checkpoint.async_save": "false"}
    base.update({k: str(v) for k, v in extra.items()})
    return base


def tiny_config(arg, cache_dir, steps=20, **extra):
    config = pretrain_config.get_config(arg)
    config_lib.apply_overrides(config, tiny_overrides(steps, **extra))
    with config.unlocked():
        config.data.cache_dir = str(cache_dir)
    return config


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache")
    os.environ["TUPE_JAX_CACHE"] = str(path)
    return path


def losses(workdir):
    return [m["loss"] for m in read_metrics(str(workdir)) if "loss" in m]


# every scheme in both families is pinned by the golden run (tests/test_behaviour.py: its exact 20-step losses,
# which are asserted to fall); here the default config (16-bit dropout masks, batch 16) over 50 steps, one per family
@pytest.mark.slow
@pytest.mark.parametrize("pe,objective", [("tupe_r", "mlm"), ("rope", "clm")])
def test_loss_falls_with_the_default_config(pe, objective, cache_dir, tmp_path):
    config = tiny_config(f"pe={pe},objective={objective}", cache_dir, steps=50)
    pretrain_loop.pretrain(config, str(tmp_path), devices=jax.devices()[:1])   # speed: sharding is tested below
    curve = losses(tmp_path)
    assert len(curve) == 50
    assert np.mean(curve[-5:]) < np.mean(curve[:5]) - 0.3, curve


def test_losses_equal_across_meshes(cache_dir, tmp_path):
    curves = {}
    for name, mesh in {"data8": (8, 1, 1), "d2f2t2": (2, 2, 2), "fsdp8": (1, 8, 1)}.items():
        config = tiny_config("pe=tupe_r", cache_dir, steps=5, **{"mesh.data": mesh[0], "mesh.fsdp": mesh[1],
                                                                  "mesh.tensor": mesh[2]})
        pretrain_loop.pretrain(config, str(tmp_path / name))
        curves[name] = losses(tmp_path / name)
    # one device, in a fresh process (the device count is fixed when JAX starts)
    config = tiny_config("pe=tupe_r", cache_dir, steps=5)
    workdir_lib.write_config(str(tmp_path / "one"), config)
    env = {**os.environ, "XLA_FLAGS": xla_flags.devices(1)}
    code = ("from tupe_jax.pretrain import loop; from tupe_jax import workdir; import sys; "
            "loop.pretrain(workdir.read_config(sys.argv[1]), sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "one")], check=True, cwd=ROOT, env=env,
                   capture_output=True)
    curves["one"] = losses(tmp_path / "one")
    assert len(curves["one"]) == 5
    for name, curve in curves.items():
        np.testing.assert_allclose(curve, curves["one"], atol=1e-5, rtol=0, err_msg=name)


def params_of(workdir):
    return jax.tree_util.tree_map(np.asarray, workdir_lib.load_run(str(workdir)).params)


# "1": the steps' dots on oneDNN, as the launcher runs them on x86 with AVX-512 (the suite's default is XLA's
# library: conftest.py);
# JAX cannot store those executables in the suite's compilation cache and says so (xla_options.py): expected here
@pytest.mark.parametrize("onednn", ["0", pytest.param("1", marks=[pytest.mark.skipif(
    platform.machine().lower() not in xla_options.X86, reason="oneDNN: x86 only"),
    pytest.mark.filterwarnings("ignore:Error writing persistent compilation cache entry")])])
def test_stop_and_resume_is_bitwise_exact(onednn, cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TUPE_JAX_ONEDNN", onednn)
    config = tiny_config("pe=tupe_r", cache_dir, steps=12)
    pretrain_loop.pretrain(config, str(tmp_path / "straight"))
    pretrain_loop.pretrain(config, str(tmp_path / "resumed"), stop_after=5)
    assert workdir_lib.load_run(str(tmp_path / "resumed")).step == 5
    pretrain_loop.pretrain(config, str(tmp_path / "resumed"), stop_after=4)
    # as if a process killed with -9 had logged steps 10 and 11 after its last checkpoint (step 9)
    with open(tmp_path / "resumed" / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 10, "loss": 99.0}\n{"step": 11, "loss": 99.0}\n')
    pretrain_loop.pretrain(config, str(tmp_path / "resumed"))
    a, b = params_of(tmp_path / "straight"), params_of(tmp_path / "resumed")
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(x, y)
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")   # redone steps logged once
    raw = [m for m in read_metrics(str(tmp_path / "resumed"), raw=True) if m.get("loss") == 99.0]
    assert len(raw) == 2   # the file itself keeps what the killed process wrote


def test_resume_onto_another_mesh_shape(cache_dir, tmp_path):
    config = tiny_config("pe=rope,objective=clm", cache_dir, steps=10, **{"mesh.data": 1, "mesh.fsdp": 8})
    pretrain_loop.pretrain(config, str(tmp_path), stop_after=5)
    saved = params_of(tmp_path)
    config = tiny_config("pe=rope,objective=clm", cache_dir, steps=10, **{"mesh.data": 2, "mesh.fsdp": 2,
                                                                          "mesh.tensor": 2})
    abstract = jax.eval_shape(lambda: saved)
    from tupe_jax import sharding
    mesh = sharding.make_mesh(config)
    assert mesh.shape == {"data": 2, "fsdp": 2, "tensor": 2}
    out = pretrain_loop.pretrain(config, str(tmp_path))
    assert out["step"] == 10 and len(losses(tmp_path)) == 10
    resumed = params_of(tmp_path)
    assert jax.tree_util.tree_structure(abstract) == jax.tree_util.tree_structure(resumed)
    # the same 10 steps uninterrupted on the first mesh: same data order, seed and schedule, so the resumed run
    # must follow it step by step. Not bitwise: another mesh shape changes the order of the sharded reductions
    # (gradient all-reduce, tensor-parallel matmul partial sums), i.e. float32 rounding only, grown over 5 steps
    # (measured on CPU: losses within 8e-8 relative, params within 1.2e-8 absolute). rtol 1e-5 on the losses; on
    # the final params rtol 1e-5 / atol 1e-7 (Adam's g/sqrt(v) can amplify the rounding of near-zero gradients,
    # but lr 3e-3 bounds each step's change).
    straight = tiny_config("pe=rope,objective=clm", cache_dir, steps=10, **{"mesh.data": 1, "mesh.fsdp": 8})
    pretrain_loop.pretrain(straight, str(tmp_path / "straight"))
    want, got = losses(tmp_path / "straight"), losses(tmp_path)
    assert [m["step"] for m in read_metrics(str(tmp_path)) if "loss" in m] == list(range(1, 11))
    assert got[:5] == want[:5]   # steps 1-5 ran on the same mesh in both runs: bitwise equal
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)
    assert abs(want[-1] - want[0]) > 100 * 1e-5 * want[0]   # the losses move far more than the tolerance
    ref = params_of(tmp_path / "straight")
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(ref), jax.tree_util.tree_leaves(resumed)):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    moved = [float(np.abs(x - y).max()) for x, y in zip(jax.tree_util.tree_leaves(saved),
                                                         jax.tree_util.tree_leaves(resumed))]
    assert max(moved) > 1e-3   # steps 6-10 changed the params by far more than the tolerance


def test_evaluate_reports_validation_metrics(cache_dir, tmp_path, monkeypatch):
    config = tiny_config("pe=alibi,objective=clm", cache_dir, steps=3)
    pretrain_loop.pretrain(config, str(tmp_path))
    monkeypatch.chdir(tmp_path.parent)   # a relative --workdir, as users type it (Orbax wants absolute paths)
    values = evaluate_lib.evaluate(tmp_path.name)
    assert values["eval_perplexity"] == pytest.approx(np.exp(values["eval_loss"]), rel=1e-6)
    last = read_metrics(str(tmp_path))[-1]
    assert last["split"] == "validation" and last["step"] == 3


def test_sigterm_checkpoints_current_step_and_exits_zero(cache_dir, tmp_path):
    workdir = tmp_path / "run"
    args = [sys.executable, "-m", "launch", "pretrain", "--config=configs/pretrain.py:pe=nopos,objective=clm",
            f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in tiny_overrides(steps=100000).items()] + \
           [f"--config.data.cache_dir={cache_dir}"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600           # a loaded machine may take minutes to start: SIGTERM only once it trains
    while time.time() < deadline and not (os.path.exists(workdir / "metrics.jsonl") and len(losses(workdir)) >= 20):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.5)
    assert len(losses(workdir)) >= 20, "no 20 steps in 600 s"
    proc.send_signal(signal.SIGTERM)
    sent_at = len(losses(workdir))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    steps = sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())
    assert steps and steps[-1] >= sent_at and steps[-1] <= len(losses(workdir)) + 1
    assert "preemption: saved step" in out


def test_swapped_tokenizer_is_refused(cache_dir, tmp_path):
    config = tiny_config("pe=nopos,objective=clm", cache_dir, steps=2)
    pretrain_loop.pretrain(config, str(tmp_path), devices=jax.devices()[:1])
    vocab = tmp_path / "tokenizer" / "vocab.txt"
    lines = vocab.read_text(encoding="utf-8").splitlines()
    lines[10], lines[11] = lines[11], lines[10]          # same size, other ids
    vocab.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"tokenizer at .*vocab\.txt.*not the one the checkpoint"):
        workdir_lib.load_run(str(tmp_path))
    config = tiny_config("pe=nopos,objective=clm", cache_dir, steps=4)
    config.train.decay_steps = 2                          # the run's schedule (it decayed to 0 at step 2)
    with pytest.raises(UserError, match="not the one the checkpoint"):
        pretrain_loop.pretrain(config, str(tmp_path), devices=jax.devices()[:1])
