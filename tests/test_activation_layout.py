"""Activation layout of the compiled train step (sharding.with_activation_layout / constrain) on 8 fake CPU devices:
fsdp keeps activations batch-sharded, tensor parallelism splits the QKV and MLP work over heads and mlp. Compile
only: the HLO's collectives and XLA's FLOPs per device."""
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from tupe_jax import optim, sharding as S, trainer as T
from tupe_jax.data.batch import LMBatch
from tupe_jax.model import ModelConfig, TransformerLM
from tupe_jax.pretrain import steps

B, L, P_ = 16, 32, 5   # batch, length, MLM predictions
COLLECTIVE = re.compile(r"= (\w+)\[([\d,]*)\](?:\{[^}]*\})? (all-gather|all-reduce|all-to-all|reduce-scatter)\(")


def _compiled(shape: tuple[int, int, int]):
    """The pretraining train step as the Trainer jits it, compiled for mesh (data, fsdp, tensor) = `shape`."""
    model = TransformerLM(ModelConfig(pe="tupe_r", objective="mlm", vocab_size=384, hidden_size=64, num_layers=1,
                                      num_heads=8, mlp_dim=256, max_len=L))
    train = ml_collections.ConfigDict(dict(steps=10, decay_steps=0, warmup_steps=2, learning_rate=1e-3,
                                           weight_decay=0.01, clip_norm=1.0, adam_b1=0.9, adam_b2=0.999,
                                           adam_eps=1e-6))
    tx, schedule = optim.make_optimizer(train)
    mesh = S.make_mesh({"data": shape[0], "fsdp": shape[1], "tensor": shape[2]})
    trainer = T.Trainer(T.init_state_fn(model, tx, L), 0, mesh, steps.make_train_step(model, tx, schedule))
    spec = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=S.batch_sharding(mesh))  # noqa: E731
    batch = LMBatch(inputs=spec((B, L), jnp.int32), targets=spec((B, L), jnp.int32),
                    weights=spec((B, L), jnp.float32), input_mask=spec((B, L), jnp.int32),
                    mlm_positions=spec((B, P_), jnp.int32), mlm_labels=spec((B, P_), jnp.int32),
                    mlm_weights=spec((B, P_), jnp.float32))
    compiled = trainer.step_fn.lower(S.abstract_with_shardings(trainer.abstract, trainer.shardings), batch).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    collectives = [(kind, [int(d) for d in dims.split(",") if d]) for dtype, dims, kind in
                   COLLECTIVE.findall(compiled.as_text()) if dtype.startswith("f")]   # not token ids
    return float(cost["flops"]), collectives


def test_fsdp_and_tensor_parallelism_keep_their_activation_layout():
    data_flops, _ = _compiled((8, 1, 1))
    _, fsdp = _compiled((1, 8, 1))
    # fsdp gathers weights only: no collective of whole-global-batch activations ((B·L, …) or (B, L, …))
    global_batch = [(k, d) for k, d in fsdp if d[:1] == [B * L] or d[:2] == [B, L]]
    assert not global_batch, global_batch
    tensor_flops, tensor = _compiled((1, 1, 8))
    # heads over tensor: the QKV output (B, L, 3, H, D) is never gathered, and the work per device is about that of
    # data parallelism (before: every device projected QKV for all heads, 2.5x at the reviewer's shape)
    assert not [(k, d) for k, d in tensor if d[:3] == [B, L, 3]], tensor
    assert tensor_flops < 1.3 * data_flops, (tensor_flops, data_flops)


def test_constrain_is_the_identity_outside_a_layout():
    x = jnp.ones((2, 4, 8))
    assert S.constrain(x, ("batch", "length", "embed")) is x
    mesh = S.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    laid_out = jax.jit(S.with_activation_layout(lambda v: S.constrain(v * 2, ("batch", "length", "mlp")), mesh))
    np.testing.assert_array_equal(laid_out(x), x * 2)
    assert S.constrain(x, ("batch", "length", "embed")) is x   # the layout ends with the traced call


def test_a_one_device_mesh_traces_the_step_unchanged():
    """The CPU benchmark's step runs on one device: its program is the one traced before the layout existed."""
    model = TransformerLM(ModelConfig(pe="tupe_r", objective="mlm", vocab_size=384, hidden_size=64, num_layers=1,
                                      num_heads=8, mlp_dim=256, max_len=L))
    tokens = jnp.zeros((2, L), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)

    def forward(p, t):
        return model.apply(p, t, deterministic=True)
    one = S.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    plain = jax.jit(forward).lower(params, tokens).as_text()
    assert jax.jit(S.with_activation_layout(forward, one)).lower(params, tokens).as_text() == plain
