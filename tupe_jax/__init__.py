"""tupe-jax: TUPE and the positional-encoding comparison in JAX/Flax.

The library is importable and testable on its own; `launch/` is the thin CLI on top.
"""
__version__ = "0.1.0"
