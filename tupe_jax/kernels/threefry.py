"""Threefry-2x32 with 20 rounds (Salmon, Moraes, Dror, Shaw, SC 2011, "Parallel random numbers: as easy as 1, 2, 3")
written as elementwise uint32 operations, so that it runs where JAX's `threefry2x32_p` cannot: inside a Pallas
kernel that hashes its own dropout masks tile by tile from the same counters as `dropout.keep_mask16`
(`masks.py`'s in_kernel source; the default source, precomputed, draws them with XLA before the kernels).

    key (k0, k1), counter (x0, x1):   k2 = k0 ⊕ k1 ⊕ 0x1BD11BDA,   x0 += k0,  x1 += k1
    20 rounds r = 0..19:   x0 += x1;  x1 = rotl(x1, R[r mod 8]) ⊕ x0,   R = 13 15 26 6 17 29 16 24
    after rounds 4s−1 (s = 1..5):   x0 += k[s mod 3];  x1 += k[(s+1) mod 3] + s

All additions wrap modulo 2³². Bit for bit `jax.extend.random.threefry2x32_p` (tests/test_kernels.py checks
random and extreme words).

    threefry2x32(k0, k1, x0, x1) -> (y0, y1)       uint32 arrays (or scalars) of one shape
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
PARITY = 0x1BD11BDA


def _rotl(x: jax.Array, r: int) -> jax.Array:
    return (x << jnp.uint32(r)) | (x >> jnp.uint32(32 - r))


def threefry2x32(k0: jax.Array, k1: jax.Array, x0: jax.Array, x1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The two 32-bit output words for key (k0, k1) and counter words (x0, x1), all uint32 (module docstring)."""
    keys = (k0, k1, k0 ^ k1 ^ jnp.uint32(PARITY))
    x0, x1 = x0 + keys[0], x1 + keys[1]
    for r in range(20):
        x0 = x0 + x1
        x1 = _rotl(x1, ROTATIONS[r % 8]) ^ x0
        if r % 4 == 3:
            s = r // 4 + 1
            x0 = x0 + keys[s % 3]
            x1 = x1 + keys[(s + 1) % 3] + jnp.uint32(s)
    return x0, x1
