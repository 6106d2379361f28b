"""The suite's own set-up (tests/conftest.py) does what it says: the JAX compilation cache that the test processes
share takes a file lock around its reads and writes (jax writes an entry in place otherwise, and a reader in another
process could meet half of it)."""
import os

import filelock
import jax


def test_the_shared_compilation_cache_locks_its_entries(tmp_path):
    from jax._src import lru_cache  # pylint: disable=import-outside-toplevel
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] and jax.config.jax_compilation_cache_max_size > 0
    cache = lru_cache.LRUCache(str(tmp_path), max_size=jax.config.jax_compilation_cache_max_size)
    assert cache.eviction_enabled and isinstance(cache.lock, filelock.FileLock)
    cache.put("key", b"entry")
    assert cache.get("key") == b"entry"
