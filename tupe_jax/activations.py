"""The exact (erf) GELU, written in the form XLA:CPU computes cheaply.

    gelu(x) = x · Φ(x) = ½ · x · (1 + erf(x / √2))          (..., F) -> (..., F), in x's dtype

The function of BERT, TUPE and `jax.nn.gelu(approximate=False)`, written as PyTorch's and fairseq's exact GELU
are. `jax.nn.gelu` writes it as ½ · x · erfc(−x / √2), and XLA expands that erfc into two branches (a polynomial
near 0, an exp(−z²)-scaled one in the tails) joined by selects; on XLA:CPU (jaxlib 0.10) the training step then
makes three forward passes over each (tokens, 4·d) activation and keeps two of their outputs for the backward.
erf is one clamped rational polynomial without exp or selects: two forward passes (one keeps 1 + erf(x/√2)
for the backward) and one backward pass, as before.

The two forms agree to float rounding: in float32 both are within 1.1e-6 absolute of x · Φ(x) on [−12, 12] (an
ulp of |x| where |x| is large; tests/test_model.py). In the far negative tail (x < −5, where |x · Φ(x)| < 1.5e-6)
that error is most of the value, as in PyTorch's erf form; the erfc form keeps relative accuracy there, which
next to activations of order 1 makes no difference. benchmarks/RESULTS.md has the measured effect on the step.
"""
from __future__ import annotations

import math

import jax
from jax import lax

_INV_SQRT2 = 1.0 / math.sqrt(2.0)


def gelu(x: jax.Array) -> jax.Array:
    """Exact GELU, ½ · x · (1 + erf(x / √2)) (module docstring)."""
    return 0.5 * x * (1.0 + lax.erf(x * _INV_SQRT2))
