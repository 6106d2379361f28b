"""model.dropout_bits=16 (tupe_jax/dropout.py): the masks' statistics, the unbiased scaling, every 16-bit half used
once, both key kinds, the model and train step with it, and the refusal of other values."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tupe_jax.dropout import Dropout16, keep_bits16, keep_mask16, threshold16

N = 1 << 20


def _within(fraction: float, p: float, n: int, sigmas: float = 6.0) -> bool:
    return abs(fraction - p) <= sigmas * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("keep", [0.9, 0.5, 0.123])
def test_keep_fraction_is_the_realised_probability(keep):
    for seed in range(3):
        mask, p = keep_mask16(jax.random.PRNGKey(seed), (N // 1024, 1024), keep)
        assert p == round(keep * 65536) / 65536 and mask.shape == (N // 1024, 1024) and mask.dtype == jnp.bool_
        assert _within(float(jnp.mean(mask)), p, N)


def test_the_four_masks_of_one_hash_are_independent():
    """Elements j, j+q, j+2q, j+3q (q = n/4) come from one hash (the halves of its two words): if a half were
    reused, pairs would agree far more often than p² + (1−p)²; neighbours come from different hashes."""
    mask, p = keep_mask16(jax.random.PRNGKey(7), (N,), 0.5)
    m, q = np.asarray(mask), N // 4
    both = p * p + (1 - p) * (1 - p)
    for other in (1, 2, 3):
        assert _within(float(np.mean(m[:q] == m[other * q:(other + 1) * q])), both, q)
    assert _within(float(np.mean(m[0::2] == m[1::2])), both, N // 2)               # neighbouring hashes


@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 130), (4, 4, 16, 16)])
def test_mask_layout_is_the_documented_one(shape):
    """Element (…, j + k·q) of a mask is half k (low/high 16 bits of word 0, then of word 1) of hash (…, j), whose
    counter is (…, j)'s row-major index: rebuilt here in NumPy from the raw threefry words, so a change of layout
    (which would change every run's masks and break an exact resume) fails."""
    from jax.extend.random import threefry2x32_p  # pylint: disable=import-outside-toplevel
    key = jax.random.PRNGKey(sum(shape))
    q = -(-shape[-1] // 4)
    count = int(np.prod(shape[:-1])) * q
    counters = jnp.arange(count, dtype=jnp.uint32).reshape(shape[:-1] + (q,))
    words = [np.asarray(w) for w in threefry2x32_p.bind(key[0], key[1], counters, jnp.zeros_like(counters))]
    halves = [words[0] & 0xFFFF, words[0] >> 16, words[1] & 0xFFFF, words[1] >> 16]
    expected = np.concatenate([h < 58982 for h in halves], axis=-1)[..., :shape[-1]]
    mask, _ = keep_mask16(key, shape, 0.9)
    np.testing.assert_array_equal(np.asarray(mask), expected)


def test_the_cpu_mask_hashes_without_a_loop():
    """On XLA:CPU the masks' threefry hash is written out (`kernels/threefry.py`): the compiled mask and the train
    step's dropout hold no while loop (JAX's `threefry2x32_p` lowers to one there), with the same bits as the
    primitive (test_mask_layout_is_the_documented_one)."""
    import re  # pylint: disable=import-outside-toplevel
    assert jax.default_backend() == "cpu"
    text = jax.jit(lambda k: keep_mask16(k, (4, 4, 16, 16), 0.9)[0]).lower(jax.random.PRNGKey(0)).compile().as_text()
    assert " while(" not in text
    x = jnp.ones((2, 8, 32))
    dropped = jax.jit(lambda x, k: Dropout16(0.1).apply({}, x, False, rngs={"dropout": k}))
    text = dropped.lower(x, jax.random.PRNGKey(1)).compile().as_text()
    # flax's key derivation (fold_in) may loop over its 4 words; nothing of the mask's 128 hashes loops
    looped = [int(np.prod([int(d) for d in dims.split(",")])) for line in text.splitlines() if " while(" in line
              for dims in re.findall(r"\[([0-9,]+)\]", line.split(" while(")[0])]
    assert max(looped, default=0) <= 4, looped


def test_a_batch_sharded_mask_is_made_shard_by_shard():
    """Under a mesh that shards the batch, each device's program holds only its own counters and bits (the
    (64, 128, 256) mask on 8 devices: no array of the whole mask's or hashes' size), and the mask equals the unsharded one."""
    import re  # pylint: disable=import-outside-toplevel
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    sharded = NamedSharding(mesh, P("data"))
    f = jax.jit(lambda k: keep_mask16(k, (64, 128, 256), 0.9)[0], out_shardings=sharded)
    text = f.lower(jax.random.PRNGKey(3)).compile().as_text()
    def largest(dtype: str) -> int:
        return max(int(np.prod([int(d) for d in dims.split(",")])) for dims in re.findall(dtype + r"\[([0-9,]+)\]",
                                                                                          text))
    assert largest("u32") == 8 * 128 * 64           # one device's share of the hashes (one per 4 elements)
    assert largest("pred") == 8 * 128 * 256         # and of the (64, 128, 256) mask
    assert (np.asarray(f(jax.random.PRNGKey(3))) == np.asarray(keep_mask16(jax.random.PRNGKey(3), (64, 128, 256),
                                                                          0.9)[0])).all()


def test_odd_sizes_and_an_rbg_key():
    mask, p = keep_mask16(jax.random.PRNGKey(1), (3, 5, 7), 0.9)
    assert mask.shape == (3, 5, 7)
    key = jax.random.key(3, impl="rbg")
    mask, p = keep_mask16(key, (N,), 0.9)
    assert _within(float(jnp.mean(mask)), p, N)


@pytest.mark.parametrize("shape,key", [((2, 3, 64, 64), "threefry"), ((3, 5, 10), "threefry"), ((7,), "rbg"),
                                       ((2, 4, 128, 128), "rbg")])
def test_keep_bits16_packs_keep_mask16_one_byte_per_hash(shape, key):
    """Bit t of keep_bits16's byte (…, c) is keep_mask16's element (…, c + t·q), q = ceil(L/4), for the same rng
    (what the flash kernel reads instead of hashing); bits past L (L not a multiple of 4) are the padding hash's."""
    rng = jax.random.key(3, impl="rbg") if key == "rbg" else jax.random.PRNGKey(3)
    mask, _ = keep_mask16(rng, shape, 0.7)
    bits = keep_bits16(rng, shape, 0.7)
    q = -(-shape[-1] // 4)
    assert bits.dtype == jnp.int8 and bits.shape == shape[:-1] + (q,)
    unpacked = np.concatenate([(np.asarray(bits) >> t) & 1 for t in range(4)], axis=-1)[..., :shape[-1]]
    np.testing.assert_array_equal(unpacked.astype(bool), np.asarray(mask))
    assert 0 <= int(bits.min()) and int(bits.max()) <= 15


def test_dropout16_is_unbiased_and_keeps_or_zeroes():
    x = jnp.full((N // 256, 256), 2.0)
    for seed in range(3):
        y = Dropout16(0.1).apply({}, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(seed)})
        values = set(np.unique(np.asarray(y)).tolist())
        p = 58982 / 65536
        assert values == {0.0, float(np.float32(2.0) * np.float32(1 / p))}
        assert abs(float(jnp.mean(y)) - 2.0) <= 6 * 2.0 * math.sqrt((1 - p) / p / N)
    assert (Dropout16(0.1).apply({}, x, deterministic=True) == x).all()


@pytest.mark.parametrize("rate", [0.05, 0.1, 0.15, 0.3])
def test_dropout16_in_bfloat16_scales_each_kept_value_by_the_exact_ratio(rate):
    """Each kept value is x·2¹⁶/t rounded once to bfloat16, so E[y] = x up to that rounding; the scale rounded to
    bfloat16 first made every kept value 0.16% small at rate 0.1 (and 0.27% large at 0.15)."""
    x = jax.random.normal(jax.random.PRNGKey(3), (512, 512)).astype(jnp.bfloat16)
    y = np.asarray(Dropout16(rate).apply({}, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(0)}),
                   np.float32)
    exact = np.asarray(x, np.float32) * (65536 / threshold16(1 - rate))
    kept = y != 0
    expected = np.asarray(jnp.asarray(exact).astype(jnp.bfloat16), np.float32)
    assert (y[kept] == expected[kept]).all()
    assert abs(float(np.mean(y[kept] / exact[kept])) - 1) < 2e-4     # rounding to nearest: no bias in the mean


def test_a_model_with_16_bit_masks_trains_deterministically_and_evaluates_as_before():
    from configs.pretrain import get_config  # pylint: disable=import-outside-toplevel
    from tupe_jax.model import ModelConfig, TransformerLM  # pylint: disable=import-outside-toplevel
    config = get_config("pe=tupe_r,size=tiny")
    tokens = jax.random.randint(jax.random.PRNGKey(0), (4, 32), 5, config.model.vocab_size)
    out = {}
    for bits in (32, 16):
        with config.unlocked():
            config.model.dropout_bits, config.model.max_len = bits, 32
        model = TransformerLM(ModelConfig.from_config(config.model))
        params = model.init(jax.random.PRNGKey(0), tokens)["params"]
        train = [model.apply({"params": params}, tokens, deterministic=False,
                             rngs={"dropout": jax.random.PRNGKey(5)})["logits"] for _ in range(2)]
        assert (train[0] == train[1]).all()                   # same key, same masks
        out[bits] = (params, train[0], model.apply({"params": params}, tokens)["logits"])
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: (a == b).all(), out[16][0], out[32][0]))
    assert (out[16][2] == out[32][2]).all()                   # evaluation has no dropout: identical
    assert not jnp.allclose(out[16][1], out[32][1])           # training draws other masks


def test_other_bit_counts_are_refused():
    from configs.pretrain import get_config  # pylint: disable=import-outside-toplevel
    from tupe_jax.errors import UserError  # pylint: disable=import-outside-toplevel
    from tupe_jax.model import validate_config  # pylint: disable=import-outside-toplevel
    config = get_config("pe=bert_a,size=tiny")
    with config.unlocked():
        config.model.dropout_bits = 8
    with pytest.raises(UserError, match=r"unknown model.dropout_bits 8.*--config.model.dropout_bits.*32\|16"):
        validate_config(config.model)


def test_a_mask_past_2_32_hashes_is_refused_where_its_counters_would_wrap():
    """The hashes' counters are one uint32 word: at batch 342 × 12 heads × 2048² the attention mask's hash
    (341, 4, 0, 0) has counter ((341·12 + 4)·2048)·512 = 2³², the counter of (0, 0, 0, 0): the same mask block.
    Refused before any compute (`model.validate_training`) and at trace time; one example fewer fits."""
    from configs.pretrain import get_config  # pylint: disable=import-outside-toplevel
    from tupe_jax import model as model_lib  # pylint: disable=import-outside-toplevel
    from tupe_jax.errors import UserError  # pylint: disable=import-outside-toplevel
    assert ((341 * 12 + 4) * 2048) * 512 == 2 ** 32
    key = jax.random.PRNGKey(0)
    jax.eval_shape(lambda k: keep_mask16(k, (341, 12, 2048, 2048), 0.9)[0], key)      # traced only: no compute
    with pytest.raises(ValueError, match=r"needs 4303355904 hashes, past the 4294967296 .*dropout_bits=32"):
        jax.eval_shape(lambda k: keep_mask16(k, (342, 12, 2048, 2048), 0.9)[0], key)
    config = get_config("pe=tupe_r,size=base")
    with config.unlocked():
        config.model.max_len, config.model.dropout_bits, config.train.batch_size = 2048, 16, 341
    model_lib.validate_training(config, "cpu", (2048,))
    config.train.batch_size = 342
    with pytest.raises(UserError, match=r"16-bit dropout mask of shape \(342, 12, 2048, 2048\) \(train.batch_size "
                                        r"342\) needs 4303355904 hashes.*, --config.model.dropout_bits, set it to 32"):
        model_lib.validate_training(config, "cpu", (2048,))
    config.model.attention_dropout_rate = 0.0               # no attention mask: the hidden ones are far smaller
    model_lib.validate_training(config, "cpu", (2048,))
    config.model.attention_dropout_rate, config.model.dropout_bits = 0.1, 32
    model_lib.validate_training(config, "cpu", (2048,))


def test_32_bit_dropout_is_flax_in_float32_and_scales_exactly_in_bfloat16():
    """The 32-bit module draws flax's masks (its class keeps flax's name: modules keep their names and rng streams)
    and gives flax's values bit for bit in float32; in bfloat16 flax divides by bf16(0.9) = 0.8984375, every kept
    value 0.17% large, and this module divides in float32 and rounds once."""
    import flax.linen as nn  # pylint: disable=import-outside-toplevel
    from tupe_jax.dropout import make_dropout  # pylint: disable=import-outside-toplevel
    ours, theirs = make_dropout(0.1, 32), nn.Dropout(0.1)
    assert type(ours).__name__ == "Dropout"
    rngs = {"dropout": jax.random.PRNGKey(5)}
    x = jax.random.normal(jax.random.PRNGKey(3), (512, 512))
    assert (np.asarray(ours.apply({}, x, deterministic=False, rngs=rngs))
            == np.asarray(theirs.apply({}, x, deterministic=False, rngs=rngs))).all()
    h = x.astype(jnp.bfloat16)
    y = np.asarray(ours.apply({}, h, deterministic=False, rngs=rngs), np.float32)
    flax_y = np.asarray(theirs.apply({}, h, deterministic=False, rngs=rngs), np.float32)
    assert ((y != 0) == (flax_y != 0)).all()                              # the same mask
    kept, exact = y != 0, np.asarray(h, np.float32) / 0.9
    assert (y[kept] == np.asarray(jnp.asarray(exact[kept]).astype(jnp.bfloat16), np.float32)).all()
    assert abs(float(np.mean(y[kept] / exact[kept])) - 1) < 2e-4
    assert float(np.mean(flax_y[kept] / exact[kept])) - 1 > 1e-3            # flax's bias, which this removes
    assert (ours.apply({}, h, deterministic=True) == h).all()
