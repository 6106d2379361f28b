"""tupe_jax/kernels/: Threefry as uint32 array operations and the Pallas flash-attention kernel (issue #18).

The kernel runs here through Pallas' interpreter (the same kernel code the GPU compiles with Triton) and must
equal the einsum path of `attention.py` — softmax attention with the positional bias, the mask and 16-bit dropout
whose masks come from `dropout.keep_mask16` for the same key — in values and in the gradients of q, k, v and the
bias (float32 to 1e-5; bf16 within its rounding), with its mask from either source (`kernels/masks.py`: bytes
precomputed by `dropout.keep_bits16`, or hashed in the kernels). It must also still lower to Triton for CUDA. (The kernel in the model:
test_kernels_model.py.)
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.random import threefry2x32_p

from tupe_jax import attention
from tupe_jax.dropout import apply_mask16, keep_bits16, keep_mask16
from tupe_jax.kernels import flash
from tupe_jax.kernels.threefry import threefry2x32

SCALE = 0.125
KEY = jax.random.PRNGKey(42)


def test_threefry_is_jaxs_primitive_bit_for_bit():
    """The written-out Threefry-2x32-20 equals `threefry2x32_p` on random words and on the extreme ones."""
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2 ** 32, (4, 4096), dtype=np.uint64).astype(np.uint32)
    words[:, :4] = [[0, 0, 0xFFFFFFFF, 0xFFFFFFFF]] * 4
    for k0, k1 in ((0, 0), (0xFFFFFFFF, 0xFFFFFFFF), (0x12345678, 0x9ABCDEF0)):
        k0, k1 = jnp.uint32(k0), jnp.uint32(k1)
        expected = threefry2x32_p.bind(k0, k1, jnp.asarray(words[0]), jnp.asarray(words[1]))
        got = threefry2x32(k0, k1, jnp.asarray(words[0]), jnp.asarray(words[1]))
        for e, g in zip(expected, got):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


def test_the_kernel_masks_logits_as_the_einsum_path_does():
    """Its own copy of the masked-logit value (the kernel module must not import attention.py) equals the einsum
    path's, and its 16-bit threshold is keep_mask16's (`dropout.threshold16`) for the same rate."""
    assert flash.NEG_INF == attention.NEG_INF
    spec = flash._Spec(jnp.zeros((1, 64, 1, 16)), None, None, 1.0, 0.1, 64, 64)  # pylint: disable=protected-access
    keep, p = keep_mask16(KEY, (4,), 0.9)
    assert spec.threshold / 65536 == p and spec.inv_keep == 1.0 / p and keep.dtype == bool


def reference(q, k, v, bias, mask, rate):
    """The einsum path's maths: softmax(scale·q kᵀ + bias, NEG_INF where masked), keep_mask16 dropout, · v."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * SCALE
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = jnp.where(mask, s, attention.NEG_INF)
    p = jax.nn.softmax(s, axis=-1)
    if rate > 0:
        p = apply_mask16(p, KEY, rate)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(q.dtype), v)


SOURCES = ("precomputed", "in_kernel")    # where the kernels' dropout mask comes from (kernels/masks.py)


def kernel(q, k, v, bias, mask, rate, blocks=(64, 64), source="precomputed"):
    """The kernel with the mask of KEY: the key's words hashed in the kernels, or keep_bits16's bytes."""
    batch, length, heads, _ = q.shape
    bits = keep_bits16(KEY, (batch, heads, length, length), 1.0 - rate) if source == "precomputed" and rate else None
    return flash.flash_attention(q, k, v, bias, mask, jax.random.key_data(KEY) if source == "in_kernel" else None,
                                 keep_bits=bits, scale=SCALE, dropout_rate=rate, block_q=blocks[0],
                                 block_k=blocks[1], interpret=True)


@pytest.mark.parametrize("source", SOURCES)
def test_the_kernels_masks_are_keep_mask16s(source):
    """q = k = 0 makes every probability 1/L and v = the identity reads them out: out[b, i, h, j] > 0 exactly
    where keep_mask16(key, (B, H, L, L)) keeps (b, h, i, j) — across key tiles and the four quarters of a hash."""
    b, length, heads = 2, 128, 2
    q = jnp.zeros((b, length, heads, length))
    v = jnp.broadcast_to(jnp.eye(length)[None, :, None, :], (b, length, heads, length))
    out = kernel(q, q, v, None, None, 0.25, source=source)
    keep, p = keep_mask16(KEY, (b, heads, length, length), 0.75)
    np.testing.assert_array_equal(np.asarray(out > 0).transpose(0, 2, 1, 3), np.asarray(keep))
    kept = np.asarray(out)[np.asarray(out) > 0]
    np.testing.assert_allclose(kept, 1.0 / length / p, rtol=1e-6)
    assert 0.70 < float(keep.mean()) < 0.80


def _inputs(batch=2, length=128, heads=2, dim=24, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q, k, v, g = (jax.random.normal(ks[i], (batch, length, heads, dim)).astype(dtype) for i in range(4))
    bias = jax.random.normal(ks[4], (1, heads, length, length)) * 2.0
    padding = jnp.arange(length)[None, :] < jnp.array([length, length - 45])[:batch, None]
    return q, k, v, g, bias, padding[:, None, None, :] & jnp.ones((1, 1, length, length), bool)


CASES = {   # name -> (bias's (batch, heads) or None, mask kind, dropout rate, (query tile, key tile))
    "plain": (None, None, 0.0, (64, 64)),
    "bias, padding, dropout": ((1, 2), "padding", 0.1, (64, 64)),
    "causal, dropout": (None, "causal", 0.1, (64, 64)),
    "bias, causal and padding, dropout 0.3": ((1, 2), "both", 0.3, (64, 64)),
    "bias, padding, dropout; key tiles 128 forward, 64 backward": ((1, 2), "padding", 0.1, (64, 128)),
    "bias per row, causal and padding, dropout": ((2, 2), "both", 0.1, (64, 64)),
    "bias per row shared over heads, padding, dropout": ((2, 1), "padding", 0.1, (64, 64)),
    "one bias plane for all rows and heads, causal": ((1, 1), "causal", 0.0, (64, 64)),
}


@pytest.mark.parametrize("case,source", [(case, source) for case in sorted(CASES) for source in SOURCES
                                         if CASES[case][2] > 0 or source == "precomputed"])   # no mask: one run
def test_the_kernel_equals_the_einsum_path_with_its_gradients(case, source):
    """float32: output and the gradients of q, k, v (and the bias, whichever of its batch and head axes it has:
    the bias-gradient kernel sums over the others) within 1e-5 of the einsum path's, at a head dim (24) padded to
    32, two query tiles and two key tiles (or one of 128 keys in the forward and the backward's two of 64:
    `flash.BACKWARD_BLOCK_K`); the dropout mask from either source."""
    bias_axes, mask_kind, rate, blocks = CASES[case]
    q, k, v, g, _, padding = _inputs()
    causal = jnp.tril(jnp.ones((128, 128), bool))[None, None]
    mask = {None: None, "padding": padding, "causal": causal, "both": padding & causal}[mask_kind]
    bias = None if bias_axes is None else jax.random.normal(jax.random.PRNGKey(5), (*bias_axes, 128, 128)) * 2.0
    args = (0, 1, 2) if bias is None else (0, 1, 2, 3)

    def loss(fn, **kw):
        return lambda q, k, v, b: jnp.sum(fn(q, k, v, b, mask, rate, **kw) * g)

    np.testing.assert_allclose(kernel(q, k, v, bias, mask, rate, blocks, source),
                               reference(q, k, v, bias, mask, rate), atol=1e-5, rtol=1e-5)
    expected = jax.grad(loss(reference), args)(q, k, v, bias)
    got = jax.grad(loss(kernel, blocks=blocks, source=source), args)(q, k, v, bias)
    for name, e, o in zip("q k v bias".split(), expected, got):
        scale = float(jnp.abs(e).max())
        assert scale > 0
        np.testing.assert_allclose(np.asarray(o) / scale, np.asarray(e) / scale, atol=1e-5, err_msg=name)


def test_bfloat16_inputs_stay_within_bf16_rounding():
    """bf16 q, k, v (float32 bias and softmax inside, bf16 P·V operands as the einsum path): within a few bf16
    units of the float32 einsum path on the same values."""
    q, k, v, g, bias, padding = _inputs(dim=64, dtype=jnp.bfloat16, seed=3)
    got = kernel(q, k, v, bias, padding, 0.1).astype(jnp.float32)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = reference(*f32, bias, padding, 0.1)
    assert got.dtype == jnp.float32 and float(jnp.abs(got - want).max()) <= 4 * 2.0 ** -8 * float(jnp.abs(want).max())


def test_unsupported_lengths_and_missing_keys_are_refused():
    q = jnp.zeros((1, 96, 1, 16))
    assert not flash.supported(96, 64) and flash.supported(128, 64) and not flash.supported(128, 32)
    with pytest.raises(ValueError, match="does not tile"):
        flash.flash_attention(q, q, q, scale=1.0, interpret=True)
    q = jnp.zeros((1, 64, 1, 16))
    with pytest.raises(ValueError, match="needs keep_bits or the rng"):
        flash.flash_attention(q, q, q, scale=1.0, dropout_rate=0.1, interpret=True)
    for bits in (keep_bits16(KEY, (1, 1, 64, 32), 0.9), keep_bits16(KEY, (1, 1, 64, 64), 0.9).astype(jnp.uint8)):
        with pytest.raises(ValueError, match=r"keep_bits is .*, not int8\[1, 1, 64, 16\]"):
            flash.flash_attention(q, q, q, keep_bits=bits, scale=1.0, dropout_rate=0.1, interpret=True)
    assert flash.blocks(128) == (64, 128) and flash.blocks(192) == (64, 64) and flash.blocks(512) == (64, 128)


@pytest.mark.parametrize("source", SOURCES)
def test_the_kernels_lower_to_triton_for_cuda(source):
    """Lowered for CUDA on this CPU-only machine (no compile), for an abstract H200 (JAX ≥ 0.11 asks for the target
    device; the device tool's H200 runs 0.11.2): the forward is one Triton call, the gradient three (forward,
    dK/dV, dQ) and a fourth (the bias gradient) when the bias is differentiated; bf16 at BERT-base's head size,
    bias, mask and dropout on. With precomputed masks no kernel hashes (no xor in any kernel: Threefry's rounds
    are the only xors) and XLA hashes once, outside them (with JAX's primitive, as a CUDA lowering compiles it;
    the program also holds the CPU's written-out hash, `dropout._hash_words`, a branch the compile drops)."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    q = jax.ShapeDtypeStruct((2, 512, 12, 64), jnp.bfloat16)
    bias, mask = jax.ShapeDtypeStruct((1, 12, 512, 512), jnp.float32), jax.ShapeDtypeStruct((2, 1, 512, 512), bool)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)

    def forward(q, k, v, b, m, key):
        bits = keep_bits16(key, (2, 12, 512, 512), 0.9) if source == "precomputed" else None
        return flash.flash_attention(q, k, v, b, m, None if bits is not None else key, keep_bits=bits, scale=SCALE,
                                     dropout_rate=0.1, block_q=64, block_k=128)

    grad = functools.partial(jax.grad, lambda *a: jnp.sum(forward(*a).astype(jnp.float32)))
    for fn, calls in ((forward, 1), (grad((0, 1, 2)), 3), (grad((0, 1, 2, 3)), 4)):
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(fn).trace(q, q, q, bias, mask, key).lower(lowering_platforms=("cuda",)).as_text()
            jaxpr = jax.make_jaxpr(fn)(q, q, q, bias, mask, key)
        program, kernels = str(jaxpr), _kernel_jaxprs(jaxpr.jaxpr)
        assert re.findall(r"custom_call @(\S+)\(", text) == ["__gpu$xla.gpu.triton"] * calls
        assert "2x12x512x512xf32" not in text     # no per-row buffer of dS for a bias shared over the batch
        assert len(kernels) == calls
        assert (sum(k.count("xor") for k in kernels) == 0) == (source == "precomputed")
        assert program.count("threefry2x32") == (source == "precomputed")


def _kernel_jaxprs(jaxpr) -> list[str]:
    """The text of every pallas_call kernel's jaxpr in `jaxpr`, nested calls included."""
    found = []
    for eqn in jaxpr.eqns:
        subs = [getattr(v, "jaxpr", v) for p in eqn.params.values()
                for v in (p if isinstance(p, (tuple, list)) else (p,))]
        found += [str(eqn.params["jaxpr"])] if eqn.primitive.name == "pallas_call" else [
            k for sub in subs if hasattr(sub, "eqns") for k in _kernel_jaxprs(sub)]
    return found
