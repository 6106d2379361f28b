"""oneDNN for XLA:CPU's dots in the train and eval steps (tupe_jax/xla_options.py): when it applies, that the
trainer's step really runs its dots there, and that the step computes the same loss and gradients as with XLA's
default library. The suite itself runs with TUPE_JAX_ONEDNN=0 (tests/conftest.py says why)."""
import os
import platform
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import pretrain as pretrain_config
from tupe_jax import config as config_lib
from tupe_jax import sharding as sharding_lib
from tupe_jax import trainer as trainer_lib
from tupe_jax import xla_options
from tupe_jax.data.batch import LMBatch
from tupe_jax.errors import UserError
from tupe_jax.model import ModelConfig, TransformerLM
from tupe_jax.optim import make_optimizer
from tupe_jax.pretrain import steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_x86 = pytest.mark.skipif(platform.machine().lower() not in xla_options.X86,
                               reason="XLA:CPU builds its oneDNN support for x86 only")

# The oneDNN executables these tests compile cannot go into the suite's compilation cache; JAX warns each time
# (the known limit in tupe_jax/xla_options.py), which is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:Error writing persistent compilation cache entry")


def test_onednn_on_x86_xla_cpu_with_avx512_unless_set_otherwise():
    assert xla_options.dot_library("cpu", "x86_64", {}, True) == "onednn"
    assert xla_options.step_options("cpu", "x86_64", {}, True) == xla_options.ONEDNN_DOTS
    assert xla_options.dot_library("cpu", "x86_64", {}, False) == "xla"       # AVX2 only: XLA's library
    assert xla_options.step_options("cpu", "x86_64", {}, False) is None
    assert xla_options.dot_library("cpu", "AMD64", {"TUPE_JAX_ONEDNN": "1"}, False) == "onednn"
    for avx512 in (True, False, None):
        assert xla_options.dot_library("cpu", "x86_64", {"TUPE_JAX_ONEDNN": "0"}, avx512) == "xla"
        assert xla_options.step_options("cpu", "x86_64", {"TUPE_JAX_ONEDNN": "0"}, avx512) is None
        for env in ({}, {"TUPE_JAX_ONEDNN": "1"}):
            assert xla_options.dot_library("cpu", "aarch64", env, avx512) == "xla"
            assert xla_options.dot_library("gpu", "x86_64", env, avx512) == "xla"
            assert xla_options.dot_library("tpu", "x86_64", env, avx512) == "xla"
            assert xla_options.step_options("gpu", "x86_64", env, avx512) is None


def test_the_default_reads_avx512_from_the_cpus_flags(monkeypatch, tmp_path):
    def has(text):
        (tmp_path / "cpuinfo").write_text(text)
        return xla_options.cpu_has_avx512(str(tmp_path / "cpuinfo"))
    line = "flags\t\t: fpu vme sse sse2 avx f16c fma avx2 {} bmi2\n"
    assert has("processor\t: 0\n" + line.format("avx512f avx512dq avx512vl")) is True
    assert has(line.format("")) is False
    assert has(line.format("avx512_vnni avx512vl")) is False      # no AVX-512 Foundation
    assert has("model name\t: avx512f\n") is None                 # no flags line
    assert xla_options.cpu_has_avx512(str(tmp_path / "absent")) is None
    # flags that cannot be read (None): oneDNN, the rule before AVX-512 counted
    for avx512, library in ((True, "onednn"), (False, "xla"), (None, "onednn")):
        monkeypatch.setattr(xla_options, "cpu_has_avx512", lambda v=avx512: v)
        assert xla_options.dot_library("cpu", "x86_64", {}) == library
    if os.path.isfile("/proc/cpuinfo"):   # this machine: the first flags line of the file, read independently
        flags = next(line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags"))
        monkeypatch.undo()
        assert xla_options.cpu_has_avx512() is ("avx512f" in flags)


def test_a_setting_other_than_0_or_1_is_refused():
    with pytest.raises(UserError, match=r"^error: TUPE_JAX_ONEDNN='yes' is neither 0 nor 1, the environment, set "
                                        r"TUPE_JAX_ONEDNN=0 \(XLA's default dot library\), 1 \(oneDNN on every x86 "
                                        r"CPU\) or unset it \(oneDNN where the CPU has AVX-512\)$"):
        xla_options.dot_library("cpu", "x86_64", {"TUPE_JAX_ONEDNN": "yes"})


def test_the_launcher_refuses_a_bad_setting_before_any_work(tmp_path):
    workdir = tmp_path / "run"
    env = {**os.environ, "TUPE_JAX_ONEDNN": "true", "TUPE_JAX_HUGEPAGES": "0"}
    proc = subprocess.run([sys.executable, "-m", "launch", "pretrain", "--config=configs/pretrain.py",
                           f"--workdir={workdir}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: TUPE_JAX_ONEDNN='true' is neither 0 nor 1, the environment, "
                                                "set TUPE_JAX_ONEDNN=0 (XLA's default dot library), 1 (oneDNN on "
                                                "every x86 CPU) or unset it (oneDNN where the CPU has AVX-512)"]
    assert not workdir.exists()


def _tiny(pe: str):
    config = pretrain_config.get_config(f"pe={pe}")
    config_lib.apply_overrides(config, {"model.hidden_size": "64", "model.num_layers": "2", "model.num_heads": "4",
                                        "model.mlp_dim": "128", "model.vocab_size": "512", "model.max_len": "32",
                                        "train.batch_size": "8", "train.steps": "10", "train.warmup_steps": "2"})
    return config


def _batch(config, seed: int = 0) -> LMBatch:
    rng = np.random.default_rng(seed)
    b, n, v = int(config.train.batch_size), int(config.model.max_len), int(config.model.vocab_size)
    inputs = rng.integers(5, v, (b, n)).astype(np.int32)
    positions = np.sort(np.stack([rng.choice(np.arange(1, n), 5, replace=False) for _ in range(b)]), 1)
    return LMBatch(inputs=jnp.asarray(inputs), targets=None, weights=None, input_mask=jnp.ones((b, n), jnp.int32),
                   mlm_positions=jnp.asarray(positions.astype(np.int32)),
                   mlm_labels=jnp.asarray(np.take_along_axis(inputs, positions, 1)),
                   mlm_weights=jnp.ones((b, 5), jnp.float32))


def _compiled_step_text(config, monkeypatch, setting: str) -> str:
    monkeypatch.setenv("TUPE_JAX_ONEDNN", setting)
    model = TransformerLM(ModelConfig.from_config(config.model))
    tx, schedule = make_optimizer(config.train)
    mesh = sharding_lib.make_mesh(config, jax.devices()[:1])
    trainer = trainer_lib.Trainer(trainer_lib.init_state_fn(model, tx, int(config.model.max_len)), 0, mesh,
                                  steps.make_train_step(model, tx, schedule))
    state = sharding_lib.abstract_with_shardings(trainer.abstract, trainer.shardings)
    return trainer.step_fn.lower(state, _batch(config)).compile().as_text()


def dot_libraries(hlo: str) -> list[str]:
    """For each dot of a compiled module's text, the fusion kind of the custom fusion whose computation holds it
    ('__onednn_fusion', '__ynn_fusion', ...), or '' for a dot no custom fusion calls (XLA's own emitter)."""
    computation, holds_dot = "", set()
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%(\S+) .*\{\s*$", line)
        if header:
            computation = header.group(1)
        elif " dot(" in line:
            holds_dot.add(computation)
    kinds = {}
    for line in hlo.splitlines():
        called = re.search(r"kind=kCustom, calls=%([\w.\-]+).*\"kind\":\"(\w+)\"", line)
        if called:
            kinds[called.group(1)] = called.group(2)
    return [kinds.get(name, "") for name in sorted(holds_dot)]


@needs_x86
def test_the_trainers_step_runs_its_dots_on_onednn(monkeypatch):
    config = _tiny("bert_a")
    onednn = dot_libraries(_compiled_step_text(config, monkeypatch, "1"))
    assert len(onednn) >= 20 and set(onednn) == {"__onednn_fusion"}, onednn
    default = dot_libraries(_compiled_step_text(config, monkeypatch, "0"))
    assert default and "__onednn_fusion" not in default, default


@needs_x86
@pytest.mark.parametrize("pe", ["bert_a", "tupe_r"])
def test_the_onednn_step_has_the_default_steps_loss_and_gradients(pe):
    """float32, dropout on (the same masks: same key): the loss to 1e-5 relative and every gradient leaf to 1e-5 of
    its largest entry. The two libraries sum each dot's products in another order, so the last bits differ; a
    wrong product (a transposed operand, a lost batch) would move them by far more."""
    config = _tiny(pe)
    model = TransformerLM(ModelConfig.from_config(config.model))
    params = model.init({"params": jax.random.PRNGKey(1)}, jnp.zeros((1, 8), jnp.int32))["params"]
    batch, rng = _batch(config, seed=3), jax.random.PRNGKey(2)

    def loss(p):
        total, aux = steps.batch_loss(model, p, batch, rng, deterministic=False)
        return total / aux["weight"]

    grad = jax.value_and_grad(loss)
    onednn = jax.jit(grad, compiler_options=xla_options.ONEDNN_DOTS).lower(params).compile()
    # most dots on oneDNN: XLA may still fuse a score product and the mask or bias add after it for YNNPACK
    assert dot_libraries(onednn.as_text()).count("__onednn_fusion") >= 20
    (want, want_g), (got, got_g) = jax.jit(grad)(params), onednn(params)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_g), jax.tree_util.tree_leaves(want_g)):
        scale = float(np.max(np.abs(w)))
        assert scale > 0, path
        assert float(np.max(np.abs(np.asarray(g) - np.asarray(w)))) <= 1e-5 * scale, jax.tree_util.keystr(path)


@needs_x86
@pytest.mark.parametrize("setting", ["1", "0"])
def test_the_analyses_run_the_model_with_the_steps_dot_library(monkeypatch, setting):
    """extrapolate's NLL, the shared forward (probe, attention maps) and correlations' logits are compiled as the
    steps are: their dots on oneDNN when it applies (all but at most two, which XLA may fuse with the add after them
    for YNNPACK, as in the steps), none when opted out; with oneDNN the NLL is XLA's library's to 1e-5."""
    from tupe_jax.analysis import common, correlations, extrapolate  # pylint: disable=import-outside-toplevel
    monkeypatch.setenv("TUPE_JAX_ONEDNN", setting)

    def model(pe: str, objective: str):
        config = _tiny(pe)
        config_lib.apply_overrides(config, {"model.objective": objective})
        cfg = ModelConfig.from_config(config.model)
        return cfg, TransformerLM(cfg).init({"params": jax.random.PRNGKey(1)}, jnp.zeros((1, 8), jnp.int32))["params"]

    (cfg, params), (tupe_cfg, tupe_params) = model("alibi", "clm"), model("tupe_r", "mlm")
    inputs = jnp.asarray(np.random.default_rng(0).integers(5, 512, (2, 64)).astype(np.int32))  # 2 × max_len
    weights = jnp.ones(inputs.shape, jnp.float32)
    nll = extrapolate._nll_fn.__wrapped__(cfg)  # pylint: disable=protected-access
    logits = correlations._logits_fn.__wrapped__(tupe_cfg, 1)  # pylint: disable=protected-access
    compiled = {"nll": nll.lower(params, inputs, inputs, weights).compile(),
                "forward": common.forward_fn.__wrapped__(cfg, return_hidden=True).lower(params, inputs).compile(),
                "logits": logits.lower(tupe_params, inputs[:, :32]).compile()}
    for name, executable in compiled.items():
        libraries = dot_libraries(executable.as_text())
        assert libraries, name
        if setting == "1":
            assert set(libraries) <= {"__onednn_fusion", "__ynn_fusion"}, (name, libraries)
            assert libraries.count("__onednn_fusion") >= len(libraries) - 2, (name, libraries)
        else:
            assert "__onednn_fusion" not in libraries, (name, libraries)
    if setting == "0":
        return
    got, count = compiled["nll"](params, inputs, inputs, weights)
    want, _ = jax.jit(nll.__wrapped__)(params, inputs, inputs, weights)  # the same function, XLA's library
    assert float(count) == inputs.size
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
