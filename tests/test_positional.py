"""Each scheme's contribution against an independent NumPy reference written from its equation."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from tupe_jax.positional import (PositionalSettings, alibi_bias, alibi_slopes, apply_rope, relative_position_bucket,
                                 rope_angles, sinusoid_table)


# ----------------------------------------------------------------------------------------------- ALiBi
def reference_slopes(n):
    """Press et al.: 2^(-8h/n) for n = 2^k; otherwise the 2^floor(log2 n) slopes + every other 2c-slope."""
    def geometric(k):
        return [2 ** (-8 * h / k) for h in range(1, k + 1)]
    c = 1
    while c * 2 <= n:
        c *= 2
    return geometric(c) + [geometric(2 * c)[i] for i in range(0, 2 * c, 2)][: n - c]


@pytest.mark.parametrize("heads", [6, 8, 12, 16])
def test_alibi_slopes_match_reference(heads):
    np.testing.assert_allclose(alibi_slopes(heads), reference_slopes(heads), rtol=1e-7)
    assert alibi_slopes(heads).dtype == np.float32


def test_alibi_slopes_published_values():
    np.testing.assert_allclose(alibi_slopes(8), [1 / 2 ** k for k in range(1, 9)])
    np.testing.assert_allclose(alibi_slopes(12)[8:], [0.70710678, 0.35355339, 0.17677670, 0.08838835], rtol=1e-6)
    assert alibi_slopes(16)[0] == pytest.approx(2 ** -0.5) and alibi_slopes(16)[-1] == pytest.approx(2 ** -8)


@pytest.mark.parametrize("causal", [True, False])
def test_alibi_bias_matches_definition(causal):
    heads, length = 6, 7
    bias = np.asarray(alibi_bias(length, heads, causal))
    slopes = reference_slopes(heads)
    for h in range(heads):
        for i in range(length):
            for j in range(length):
                dist = (i - j) if causal else abs(i - j)
                assert bias[0, h, i, j] == pytest.approx(-slopes[h] * dist, rel=1e-6, abs=1e-7)
    assert bias.dtype == np.float32


# ----------------------------------------------------------------------------------------------- T5 buckets
def reference_bucket(rel, bidirectional, num_buckets=32, max_distance=128):
    """T5's bucket for r = key - query, written out scalar by scalar."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        if rel > 0:
            bucket += num_buckets
        n = abs(rel)
    else:
        n = max(-rel, 0)
    exact = num_buckets // 2
    if n < exact:
        return bucket + n
    large = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact))
    return bucket + min(large, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_buckets_match_reference(bidirectional):
    rel = np.arange(-300, 301)
    ours = np.asarray(relative_position_bucket(jnp.asarray(rel), bidirectional))
    np.testing.assert_array_equal(ours, [reference_bucket(int(r), bidirectional) for r in rel])


def test_t5_bucket_saturation_points():
    def left(n, bidirectional):  # key n positions to the left of the query
        return int(relative_position_bucket(jnp.asarray(-n), bidirectional))
    # bidirectional: 8 exact buckets per side; log buckets 8-11, 12-15, 16-22, 23-31, 32-45, 46-63, 64-90, >=91
    assert [left(n, True) for n in (7, 8, 11, 12, 15, 16, 22, 23, 31, 32, 45, 46, 63, 64, 90, 91, 1000)] == \
        [7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15]
    assert int(relative_position_bucket(jnp.asarray(90), True)) == 30
    assert int(relative_position_bucket(jnp.asarray(91), True)) == 31
    # causal: 16 exact buckets, saturates at 113
    assert left(15, False) == 15 and left(112, False) == 30 and left(113, False) == 31 and left(5000, False) == 31
    assert int(relative_position_bucket(jnp.asarray(5), False)) == 0  # future keys: bucket 0 (masked)


# ----------------------------------------------------------------------------------------------- sinusoidal
def test_sinusoid_matches_vaswani():
    d, positions = 16, np.arange(0, 50, 7)
    table = np.asarray(sinusoid_table(jnp.asarray(positions), d))
    for row, pos in zip(table, positions):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert row[2 * i] == pytest.approx(math.sin(angle), abs=1e-5)
            assert row[2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-5)


def test_sinusoidal_input_matches_token_embedding_scale():
    from tupe_jax.positional import Sinusoidal
    terms = Sinusoidal(PositionalSettings(hidden_size=64, num_heads=4, max_len=8)).apply({}, 500)
    vec = np.asarray(terms.input_vector)
    np.testing.assert_allclose(vec, 0.02 * math.sqrt(2) * np.asarray(sinusoid_table(jnp.arange(500), 64)), atol=1e-7)
    assert np.sqrt(np.mean(vec ** 2)) == pytest.approx(0.02, rel=0.02)


def test_fairseq_sinusoidal_matches_fairseq_definition():
    """fairseq's table, written out per element: position t = index + padding_idx + 1 (= index + 2), half h = d/2,
    feature i < h is sin(t · 10000^(−i/(h−1))), feature h + i is the cos of the same angle; amplitude 1."""
    from tupe_jax.positional import Sinusoidal
    d, length, offset = 12, 40, 3
    vec = np.asarray(Sinusoidal(PositionalSettings(hidden_size=d, num_heads=2, max_len=8,
                                                   sinusoidal_style="fairseq")).apply({}, length, offset).input_vector)
    h = d // 2
    for index in (0, 1, 17, length - 1):
        t = index + offset + 2
        for i in range(h):
            angle = t * 10000.0 ** (-i / (h - 1))
            assert vec[index, i] == pytest.approx(math.sin(angle), abs=1e-5)
            assert vec[index, h + i] == pytest.approx(math.cos(angle), abs=1e-5)
    assert np.abs(vec).max() == pytest.approx(1.0, abs=1e-3)           # amplitude 1, not scaled


def test_unknown_sinusoidal_style_is_refused():
    from tupe_jax.errors import UserError
    from tupe_jax.positional import validate_config
    import ml_collections
    model = ml_collections.ConfigDict(dict(pe="sinusoidal", rope_style="half", tupe_form="bias", rope_fraction=1.0,
                                           hidden_size=64, num_heads=4, rel_num_buckets=32, rel_max_distance=128,
                                           sinusoidal_style="tensor2tensor"))
    with pytest.raises(UserError, match="sinusoidal_style"):
        validate_config(model)


@pytest.mark.parametrize("head_dim,fraction,rotated", [(100, 0.58, 58), (180, 0.7, 126), (200, 0.29, 58),
                                                       (64, 0.35, 22), (64, 0.5, 32)])
def test_a_rope_fraction_rotates_head_dim_times_fraction_features(head_dim, fraction, rotated):
    """100 · 0.58 is 57.99999999999999 in floats: validation refused it as 57 (odd) features, and the module would
    have rotated 56; 64 · 0.35 = 22.4 rotates 22, as before."""
    import ml_collections
    from tupe_jax.positional import validate_config
    from tupe_jax.positional.rope import rotary_dim
    model = ml_collections.ConfigDict(dict(pe="rope", rope_style="half", tupe_form="bias", rope_fraction=fraction,
                                           hidden_size=head_dim, num_heads=1, rel_num_buckets=32, rel_max_distance=128,
                                           sinusoidal_style="scaled"))
    validate_config(model)
    assert rotary_dim(head_dim, fraction) == rotated


# ----------------------------------------------------------------------------------------------- RoPE
def reference_rope(x, positions, base, style, rot):
    """Block-diagonal 2x2 rotations of RoFormer eq. (13), plane i at angle m * base^(-2i/rot)."""
    out = np.array(x, dtype=np.float64)
    for li, m in enumerate(positions):
        for i in range(rot // 2):
            a, b = (i, i + rot // 2) if style == "half" else (2 * i, 2 * i + 1)
            t = m * base ** (-2 * i / rot)
            xa, xb = x[:, li, :, a], x[:, li, :, b]
            out[:, li, :, a] = math.cos(t) * xa - math.sin(t) * xb
            out[:, li, :, b] = math.sin(t) * xa + math.cos(t) * xb
    return out


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_rope_matches_reference(style, fraction):
    head_dim = 8
    rot = int(head_dim * fraction)
    x = np.random.default_rng(0).normal(size=(2, 5, 3, head_dim)).astype(np.float32)
    positions = np.arange(3, 8)
    cos, sin = rope_angles(jnp.asarray(positions), rot, 10000.0)
    ours = np.asarray(apply_rope(jnp.asarray(x), cos, sin, style))
    np.testing.assert_allclose(ours, reference_rope(x, positions, 10000.0, style, rot), atol=1e-5)


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_rope_dot_product_depends_only_on_offset(style):
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)

    def score(m, n):
        cm, sm = rope_angles(jnp.asarray([m]), 16, 10000.0)
        cn, sn = rope_angles(jnp.asarray([n]), 16, 10000.0)
        return float(jnp.sum(apply_rope(q, cm, sm, style) * apply_rope(k, cn, sn, style)))

    for delta in (0, 3, 17):
        scores = [score(m, m + delta) for m in (0, 5, 40, 300)]
        np.testing.assert_allclose(scores, scores[0], rtol=1e-4, atol=1e-4)
    assert abs(score(0, 3) - score(0, 17)) > 1e-3  # ...and does depend on it


def test_rope_conventions_differ_by_fixed_permutation():
    d = 8
    perm = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])  # interleaved pairs -> half-split pairs
    x = jnp.asarray(np.random.default_rng(2).normal(size=(1, 6, 2, d)), jnp.float32)
    cos, sin = rope_angles(jnp.arange(6), d, 10000.0)
    interleaved = apply_rope(x, cos, sin, "interleaved")
    half = apply_rope(x[..., perm], cos, sin, "half")
    np.testing.assert_allclose(np.asarray(interleaved)[..., perm], np.asarray(half), atol=1e-6)
    assert not np.allclose(np.asarray(interleaved), np.asarray(apply_rope(x, cos, sin, "half")))


def test_rope_angles_float32_under_bfloat16():
    cos, sin = rope_angles(jnp.asarray([4093]), 64, 10000.0)
    assert cos.dtype == jnp.float32
    x = jnp.ones((1, 1, 1, 64), jnp.bfloat16)
    assert apply_rope(x, cos, sin, "half").dtype == jnp.bfloat16
    # the slowest plane's phase at 4093 is exact in float32 (bf16 would be off by whole radians)
    assert float(jnp.arccos(cos[0, 0]) - 0) == pytest.approx(math.acos(math.cos(4093.0)), abs=1e-3)


def test_settings_head_dim():
    assert PositionalSettings(hidden_size=768, num_heads=12, max_len=512).head_dim == 64
