"""Checkpoint round trips, resharding on restore, keep-N, corrupt-latest fallback, data state, params-only."""
import logging
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from tupe_jax import checkpoint as ckpt
from tupe_jax import sharding
from tupe_jax import workdir as workdir_lib
from tupe_jax.errors import UserError


def _mesh(data, fsdp, tensor):
    return sharding.make_mesh(ml_collections.ConfigDict({"mesh": dict(data=data, fsdp=fsdp, tensor=tensor)}))


def _init_fn(model):
    tx = optax.adamw(1e-3)
    tokens = jnp.zeros((2, 8), jnp.int32)

    def init(rng):
        params = model.init(rng, tokens)["params"]
        return {"params": params, "opt_state": tx.init(params), "step": jnp.int32(0), "rng": jax.random.key_data(rng)}
    return init


def _build(model, mesh, seed=0):
    init = _init_fn(model)
    state, shardings = sharding.create_sharded_state(init, jax.random.key(seed), mesh)
    abstract = sharding.abstract_with_shardings(jax.eval_shape(init, jax.random.key(seed)), shardings)
    return state, abstract


def _assert_equal(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_bitwise_and_data_state(tmp_path, standin_model):
    mesh = _mesh(2, 2, 2)
    state, abstract = _build(standin_model(), mesh)
    state["step"] = jnp.int32(7)
    data_state = {"next_index": 123, "worker": [1, 2], "name": "embedded"}
    with ckpt.Checkpointer(str(tmp_path), every=1, keep=3) as c:
        assert c.save(7, state, data_state, meta={"pe": "tupe_r"})
        c.wait()
        assert c.latest_step() == 7
        restored, data = c.restore(None, abstract)
        assert c.restore_meta()["pe"] == "tupe_r"
    _assert_equal(state, restored)
    assert data == data_state
    leaf = restored["params"]["mlp_in"]["kernel"]
    assert leaf.sharding == state["params"]["mlp_in"]["kernel"].sharding


def test_restore_onto_other_mesh(tmp_path, standin_model):
    state, _ = _build(standin_model(), _mesh(1, 8, 1))
    assert not state["params"]["token_embed"].sharding.is_fully_replicated
    with ckpt.Checkpointer(str(tmp_path), every=1, keep=2) as c:
        c.save(1, state, {}, force=True)
    other = _mesh(8, 1, 1)
    _, abstract = _build(standin_model(), other, seed=1)
    with ckpt.Checkpointer(str(tmp_path), every=1, keep=2) as c:
        restored, _ = c.restore(1, abstract)
    _assert_equal(state, restored)
    for got, want in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(abstract)):
        assert got.sharding == want.sharding


def test_one_process_writes_each_replicated_array_whole(tmp_path, standin_model, monkeypatch):
    state, abstract = _build(standin_model(), _mesh(8, 1, 1))     # every array replicated on 8 devices
    sliced, slice_in_dim = [], jax.lax.slice_in_dim
    monkeypatch.setattr(jax.lax, "slice_in_dim", lambda *a, **k: sliced.append(a[0].shape) or slice_in_dim(*a, **k))
    with ckpt.Checkpointer(str(tmp_path), every=1, keep=2) as c:
        c.save(1, state, {}, force=True)
        c.wait()
        restored, _ = c.restore(1, abstract)
    assert sliced == []          # Orbax's replica-parallel write slices each array into 8 on-device pieces
    _assert_equal(state, restored)


def test_several_processes_keep_orbaxs_replica_parallel_writes(monkeypatch):
    registered = []
    monkeypatch.setattr(ckpt, "_ONE_PROCESS_HANDLER", {"registered": False})
    monkeypatch.setattr(ckpt.ocp.type_handlers, "register_type_handler", lambda *a, **k: registered.append(a))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    ckpt.write_replicas_whole_in_one_process()
    assert registered == []
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    ckpt.write_replicas_whole_in_one_process()
    ckpt.write_replicas_whole_in_one_process()
    assert len(registered) == 1 and registered[0][0] is jax.Array


def test_keep_n_and_interval(tmp_path, standin_model):
    state, _ = _build(standin_model(), _mesh(8, 1, 1))
    with ckpt.Checkpointer(str(tmp_path), every=2, keep=2, async_=False) as c:
        saved = [s for s in range(1, 8) if c.save(s, state, {"i": s})]
        assert saved == [2, 4, 6]
        assert c.save(7, state, {"i": 7}, force=True)
        assert c.all_steps() == [6, 7]


def _corrupt(step_dir):
    n = 0
    for root, _, files in os.walk(os.path.join(step_dir, "state")):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"\x00garbage")
            n += 1
    assert n > 0


def test_corrupt_latest_falls_back(tmp_path, standin_model, caplog):
    state, abstract = _build(standin_model(), _mesh(8, 1, 1))
    with ckpt.Checkpointer(str(tmp_path), every=1, keep=5, async_=False) as c:
        c.save(1, state, {"i": 1})
        c.save(2, jax.tree_util.tree_map(lambda x: x, state), {"i": 2})
    _corrupt(os.path.join(tmp_path, "checkpoints", "2"))
    with caplog.at_level(logging.WARNING), ckpt.Checkpointer(str(tmp_path), every=1, keep=5) as c:
        restored, data = c.restore(None, abstract)
        assert data == {"i": 1}
        assert c.all_steps() == [1, 2]  # nothing deleted
        with pytest.raises(UserError, match="step 2"):
            c.restore(2, abstract)
    assert "step 2" in caplog.text
    _assert_equal(state, restored)
    assert os.path.isdir(os.path.join(tmp_path, "checkpoints", "2"))


def test_unfinished_tmp_dir_is_ignored(tmp_path, standin_model):
    state, _ = _build(standin_model(), _mesh(8, 1, 1))
    with ckpt.Checkpointer(str(tmp_path), every=1, keep=5, async_=False) as c:
        c.save(3, state, {})
    os.makedirs(os.path.join(tmp_path, "checkpoints", "9.orbax-checkpoint-tmp-1234", "state"))
    with ckpt.Checkpointer(str(tmp_path), every=1, keep=5) as c:
        assert c.latest_step() == 3


def test_restore_params_only_and_meta_check(tmp_path, standin_model):
    model = standin_model()
    state, abstract = _build(model, _mesh(2, 2, 2))
    with ckpt.Checkpointer(str(tmp_path), every=1, keep=1) as c:
        c.save(5, state, {}, meta={"pe": "tupe_r", "param_shapes": ckpt.param_shapes(state["params"])})
        meta = None
    params = ckpt.restore_params(str(tmp_path), abstract_params=abstract["params"])
    _assert_equal(state["params"], params)
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(state["params"])
    with ckpt.Checkpointer(str(tmp_path), read_only=True) as c:
        meta = c.restore_meta()
    workdir_lib.check_compatible(meta, "tupe_r", ckpt.param_shapes(state["params"]))
    with pytest.raises(UserError, match="pe='tupe_r'"):
        workdir_lib.check_compatible(meta, "rope")
    shapes = ckpt.param_shapes(standin_model(embed=32).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    with pytest.raises(UserError, match="shape"):
        workdir_lib.check_compatible(meta, "tupe_r", shapes)
    # a missing step names the caller's step flag and the steps there; a missing folder, the caller's folder flag
    with pytest.raises(UserError, match=r"no checkpoint at step 4 in .*, --config\.init_step, use one of \[5\]$"):
        ckpt.restore_params(str(tmp_path), 4, where="--config.init_step", where_run="--config.init_from")
    with pytest.raises(UserError, match=r"no checkpoints at .*, --workdir, "):
        ckpt.restore_params(str(tmp_path / "elsewhere"))


def test_sigterm_sets_the_stop_flag(monkeypatch):
    import signal  # pylint: disable=import-outside-toplevel
    previous = signal.getsignal(signal.SIGTERM)
    monkeypatch.setitem(ckpt._STOP, "requested", False)  # pylint: disable=protected-access
    try:
        ckpt.install_sigterm_handler()
        assert not ckpt.stop_requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert ckpt.stop_requested()
    finally:
        signal.signal(signal.SIGTERM, previous)
