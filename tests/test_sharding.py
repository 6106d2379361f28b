"""Mesh, logical→mesh rules and batch assembly on 8 fake CPU devices."""
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tupe_jax import sharding
from tupe_jax.config import apply_overrides, load_config
from tupe_jax.errors import UserError


def _mesh(data=2, fsdp=2, tensor=2):
    return sharding.make_mesh(ml_collections.ConfigDict({"mesh": dict(data=data, fsdp=fsdp, tensor=tensor)}))


def test_eight_fake_devices():
    assert jax.device_count() == 8


def test_make_mesh_fills_minus_one():
    mesh = _mesh(data=-1, fsdp=2, tensor=1)
    assert dict(mesh.shape) == {"data": 4, "fsdp": 2, "tensor": 1}
    with pytest.raises(UserError, match="mesh"):
        _mesh(data=3, fsdp=1, tensor=1)


def test_params_land_with_expected_specs(standin_model):
    mesh = _mesh()
    model = standin_model()
    tokens = jnp.zeros((4, 8), jnp.int32)
    state, shardings = sharding.create_sharded_state(lambda r: model.init(r, tokens), jax.random.key(0), mesh)
    p = state["params"]
    expect = {
        ("token_embed",): P("tensor", "fsdp"),
        ("pos_embed",): P(None, "fsdp"),
        ("query", "kernel"): P("fsdp", "tensor"),
        ("query", "bias"): P("tensor"),
        ("mlp_in", "kernel"): P("fsdp", "tensor"),
        ("mlp_in", "bias"): P("tensor"),
        ("mlp_out", "kernel"): P("tensor", "fsdp"),
        ("ln", "scale"): P("fsdp"),
    }
    for path, spec in expect.items():
        leaf = p
        for k in path:
            leaf = leaf[k]
        assert leaf.sharding.spec == spec, (path, leaf.sharding.spec)
        assert not isinstance(leaf, jax.ShapeDtypeStruct)
    assert shardings["params"]["mlp_in"]["kernel"].spec == P("fsdp", "tensor")
    # Shards really are split: the (16, 32) mlp kernel is (8, 16) per device.
    assert p["mlp_in"]["kernel"].addressable_shards[0].data.shape == (8, 16)


def test_undivisible_dim_is_replicated(standin_model):
    mesh = _mesh(data=1, fsdp=1, tensor=8)
    model = standin_model(heads=2, mlp=12)  # 2 heads and mlp 12 don't split over tensor=8
    tokens = jnp.zeros((2, 8), jnp.int32)
    state, _ = sharding.create_sharded_state(lambda r: model.init(r, tokens), jax.random.key(0), mesh)
    assert state["params"]["query"]["kernel"].sharding.is_fully_replicated
    assert state["params"]["mlp_in"]["kernel"].sharding.is_fully_replicated
    assert state["params"]["mlp_in"]["kernel"].sharding.spec == P("fsdp")  # fsdp (size 1) kept, tensor dropped
    assert state["params"]["token_embed"].sharding.spec == P("tensor", "fsdp")  # vocab 64 does split
    assert not state["params"]["token_embed"].sharding.is_fully_replicated


def test_global_batch_sharding_and_values():
    mesh = _mesh()
    local = {"tokens": np.arange(8 * 6, dtype=np.int32).reshape(8, 6), "mask": np.ones((8, 6), np.float32)}
    batch = sharding.global_batch(local, mesh)
    assert batch["tokens"].shape == (8, 6)
    assert batch["tokens"].sharding.spec == P(("data", "fsdp"))
    np.testing.assert_array_equal(np.asarray(batch["tokens"]), local["tokens"])
    # each of the 4 data-parallel groups holds 2 rows; tensor replicas hold the same rows
    rows = sorted({tuple(s.index[0].indices(8)) for s in batch["tokens"].addressable_shards})
    assert rows == [(0, 2, 1), (2, 4, 1), (4, 6, 1), (6, 8, 1)]


def test_real_model_params_are_sharded(caplog):
    model_lib = pytest.importorskip("tupe_jax.model")
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "pretrain.py")
    config = apply_overrides(load_config(path + ":pe=tupe_r,size=tiny"),
                             {"mesh.data": "2", "mesh.fsdp": "2", "mesh.tensor": "2"})
    mesh = sharding.make_mesh(config)
    model = model_lib.TransformerLM(model_lib.ModelConfig.from_config(config.model))
    tokens = jnp.zeros((2, 16), jnp.int32)
    state, _ = sharding.create_sharded_state(
        lambda r: model.init({"params": r, "dropout": r}, tokens)["params"], jax.random.key(0), mesh)
    leaves = jax.tree_util.tree_leaves_with_path(state)
    assert leaves
    for path_, leaf in leaves:
        if leaf.ndim >= 2:
            assert not leaf.sharding.is_fully_replicated, jax.tree_util.keystr(path_)
    assert "have no rule" not in caplog.text


def test_a_batch_row_block_spread_over_two_processes_is_refused():
    """mesh.tensor wider than a host's devices: one row block on devices of two processes, each of which loads its
    own rows; JAX assembled one 'replicated' block from two different sets of rows (sums differed per host)."""
    from tupe_jax.errors import UserError  # pylint: disable=import-outside-toplevel
    from tupe_jax.sharding import check_rows_per_process  # pylint: disable=import-outside-toplevel
    two_hosts = np.repeat(np.arange(2), 4)                       # 8 devices, 4 per process, in process order
    check_rows_per_process(two_hosts.reshape(2, 1, 4), (2, 1, 4))     # tensor within a host: fine
    check_rows_per_process(two_hosts.reshape(4, 2, 1), (4, 2, 1))
    with pytest.raises(UserError, match=r"^error: batch row block 0 of mesh \(1, 1, 8\) \(data, fsdp, tensor\) lies "
                                        r"on the devices of processes \[0, 1\].*--config.mesh.tensor"):
        check_rows_per_process(two_hosts.reshape(1, 1, 8), (1, 1, 8))
    uneven = np.array([0, 0, 0, 1])                               # 3 devices on one host, 1 on the other
    with pytest.raises(UserError, match=r"the processes hold \[1, 3\] batch row blocks each"):
        check_rows_per_process(uneven.reshape(4, 1, 1), (4, 1, 1))
