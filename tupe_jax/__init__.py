"""tupe-jax: TUPE and the positional-encoding comparison in JAX/Flax.

The library is importable and testable on its own; `launch/` is the thin CLI on top. Layers, lowest first (a
module imports only from its own layer or below; tests/test_architecture.py checks it):

    errors, files, allocator, host      one-line user errors; atomic whole-file writes; XLA:CPU's malloc; the CPU
    config, positional/, dropout, head, attention, sharding, optim, metrics, plots, checkpoint, data/
                                        each owns its names and checks its own config section
    model                               the Transformer LMs and classifier; the dtype table
    workdir, trainer                    a run's folder (config.json, meta, loading); the one training loop
    pretrain/, finetune/, interop/      the two loops over the trainer, each with its validator; HF import/export
    analysis/                           tools on trained runs; the comparison suites
"""
__version__ = "0.1.0"
