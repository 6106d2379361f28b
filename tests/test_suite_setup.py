"""The suite's own set-up (tests/conftest.py) does what it says: the JAX compilation cache that the test processes
share takes a file lock around its reads and writes (jax writes an entry in place otherwise, and a reader in another
process could meet half of it), and the multi-process tests' coordinator ports lie outside the kernel's range for
outgoing connections."""
import os
import socket

import filelock
import jax


def test_the_shared_compilation_cache_locks_its_entries(tmp_path):
    from jax._src import lru_cache  # pylint: disable=import-outside-toplevel
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] and jax.config.jax_compilation_cache_max_size > 0
    cache = lru_cache.LRUCache(str(tmp_path), max_size=jax.config.jax_compilation_cache_max_size)
    assert cache.eviction_enabled and isinstance(cache.lock, filelock.FileLock)
    cache.put("key", b"entry")
    assert cache.get("key") == b"entry"


def test_a_coordinator_port_is_free_and_outside_the_ephemeral_range():
    from tests.test_multiprocess import ephemeral_ports, free_port  # pylint: disable=import-outside-toplevel
    low, _ = ephemeral_ports()
    ports = {free_port() for _ in range(20)}
    assert all(10000 <= p < low for p in ports) and len(ports) > 1
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))   # still free: the check closed its socket
