"""Mesh, logical→mesh rules and batch assembly on 8 fake CPU devices."""
import os
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tupe_jax import sharding
from tupe_jax.config import apply_overrides, load_config
from tupe_jax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


@pytest.mark.parametrize("overrides, needle", [
    ({"mesh.data": 2, "mesh.tensor": 4}, r"model.num_heads = 2 and model.mlp_dim = 64 are not both divisible by "
                                         r"mesh.tensor = 4.*, --config.mesh.tensor, use a common divisor \(1, 2\)"),
    ({"mesh.data": 2, "mesh.tensor": 4, "model.num_heads": 6, "model.mlp_dim": 192, "model.hidden_size": 48},
     r"model.num_heads = 6 and model.mlp_dim = 192 .*mesh.tensor = 4.*use a common divisor \(1, 2\) and"),
    ({"mesh.data": 1, "mesh.fsdp": 8, "model.hidden_size": 36},
     r"model.hidden_size = 36 is not divisible by mesh.fsdp = 8.*, --config.mesh.fsdp, .*\(1, 2, 4\) and")])
def test_a_mesh_that_would_replicate_the_model_is_refused_before_any_compute(overrides, needle, tmp_path, capsys):
    """fit_spec replicated these dims with a warning per leaf, and the run trained with whole weights per device."""
    import launch  # pylint: disable=import-outside-toplevel
    from tupe_jax.finetune.validate import validate  # pylint: disable=import-outside-toplevel
    tiny = {"model.num_layers": 1, "model.hidden_size": 32, "model.num_heads": 2, "model.mlp_dim": 64, **overrides}
    argv = ["pretrain", "--config=" + os.path.join(ROOT, "configs", "pretrain.py") + ":pe=tupe_r,size=tiny",
            f"--workdir={tmp_path / 'run'}", *[f"--config.{k}={v}" for k, v in tiny.items()]]
    assert launch.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and re.match("^error: " + needle, err[0]), err
    glue = apply_overrides(load_config(os.path.join(ROOT, "configs", "glue.py") + ":task=rte,pe=tupe_r"),
                           {k: str(v) for k, v in tiny.items()})
    with pytest.raises(UserError, match=needle):
        validate(glue, 8)


def test_a_vocabulary_that_does_not_split_is_replicated_and_said_once_per_parameter(caplog, monkeypatch):
    """BERT's 30522 rows over tensor 4: allowed; one line per table, not one per leaf of params, mu and nu."""
    from tupe_jax import optim, trainer  # pylint: disable=import-outside-toplevel
    from tupe_jax.model import ModelConfig, TransformerLM  # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(sharding, "_LOGGED", set())
    model = TransformerLM(ModelConfig(vocab_size=1001, hidden_size=32, num_heads=4, mlp_dim=64, num_layers=2))
    tx, _ = optim.make_optimizer(ml_collections.ConfigDict(dict(
        steps=10, decay_steps=0, warmup_steps=2, learning_rate=1e-3, weight_decay=0.01, clip_norm=1.0, adam_b1=0.9,
        adam_b2=0.999, adam_eps=1e-6)))
    abstract = jax.eval_shape(trainer.init_state_fn(model, tx, 16), jax.random.key(0))
    shardings = sharding.logical_to_shardings(abstract, _mesh(data=2, fsdp=1, tensor=4))
    assert shardings["opt_state"][1][0].mu["encoder"]["embed"]["embedding"].spec == P(None, "fsdp")
    said = [r.getMessage() for r in caplog.records if "cannot be split" in r.getMessage()]
    assert [m.split(" dim ")[0] for m in said] == ["sharding: encoder/embed/embedding", "sharding: head_bias"], said
    nu = [p for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]
          if ".nu['encoder']['blocks_1']['mlp_in']['kernel" in jax.tree_util.keystr(p)]
    assert [sharding.param_name(p) for p in nu] == ["encoder/blocks_*/mlp_in/kernel"]
