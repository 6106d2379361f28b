"""Shared test setup: 8 fake CPU devices (set before jax is imported) and the `slow` marker."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import xla_flags  # noqa: E402  (nothing of jax imported yet)

os.environ.setdefault("XLA_FLAGS", xla_flags.SUITE)   # 8 fake CPU devices, -O0 (tests/xla_flags.py says why)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests compile the same tiny programs again (each pretrain() call builds fresh closures): a persistent
# compilation cache shared by the test processes turns those recompiles into disk reads.
# ("_lru": the folder written with the size limit below alone; entries an older suite wrote without it have no
# access-time file, and one such entry fails jax's eviction scan, so that every later write is dropped.)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                                 f"tupe_jax_test_xla_cache_lru_{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# A size limit turns on the cache's file lock (filelock): without one jax writes an entry in place, and another test
# process reading it meanwhile met half a file (a warning and a recompile). 8 GiB is never reached by the suite.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
# The steps' dots on XLA's default library, not oneDNN (tupe_jax/xla_options.py): XLA cannot store an executable
# with oneDNN calls in that compilation cache, and the suite leans on the cache. tests/test_xla_options.py runs the
# oneDNN steps (the launcher's default on x86 CPUs with AVX-512) and checks them against these.
os.environ.setdefault("TUPE_JAX_ONEDNN", "0")


def pytest_configure(config):
    """Register markers used across the suite."""
    config.addinivalue_line("markers", "slow: takes more than ~10 s on 2 CPU cores (deselect with -m 'not slow')")

import flax.linen as nn  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402


def _part(init, names):
    return nn.with_logical_partitioning(init, names)


class StandInLM(nn.Module):
    """A tiny Linen LM using the model's logical-partitioning convention (until tupe_jax.model exists)."""
    vocab: int = 64
    embed: int = 16
    heads: int = 2
    mlp: int = 32
    max_len: int = 8

    @nn.compact
    def __call__(self, tokens, deterministic: bool = True):
        emb = self.param("token_embed", _part(nn.initializers.normal(0.02), ("vocab", "embed")),
                         (self.vocab, self.embed))
        pos = self.param("pos_embed", _part(nn.initializers.normal(0.02), ("pos", "embed")), (self.max_len, self.embed))
        x = emb[tokens] + pos[: tokens.shape[1]]
        kv = self.embed // self.heads
        q = nn.DenseGeneral((self.heads, kv), name="query",
                            kernel_init=_part(nn.initializers.lecun_normal(), ("embed", "heads", "kv")),
                            bias_init=_part(nn.initializers.zeros, ("heads", "kv")))(x)
        x = x + q.reshape(x.shape)
        x = nn.LayerNorm(name="ln", scale_init=_part(nn.initializers.ones, ("embed",)),
                         bias_init=_part(nn.initializers.zeros, ("embed",)))(x)
        h = nn.Dense(self.mlp, name="mlp_in", kernel_init=_part(nn.initializers.lecun_normal(), ("embed", "mlp")),
                     bias_init=_part(nn.initializers.zeros, ("mlp",)))(x)
        x = x + nn.Dense(self.embed, name="mlp_out",
                         kernel_init=_part(nn.initializers.lecun_normal(), ("mlp", "embed")),
                         bias_init=_part(nn.initializers.zeros, ("embed",)))(nn.gelu(h))
        return {"logits": x @ jnp.asarray(emb).T}


@pytest.fixture
def standin_model():
    """The stand-in LM class."""
    return StandInLM


@pytest.fixture(scope="session")
def gcs():
    """A GCS endpoint (fake-gcs-server) for the bucket tests, one per test process: tests/gcs_fixtures.py."""
    from tests.gcs_fixtures import emulator  # pylint: disable=import-outside-toplevel
    yield from emulator()
