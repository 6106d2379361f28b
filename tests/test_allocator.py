"""tupe_jax.allocator: when `python -m launch` re-executes itself with glibc's huge-page tunable, and that it does."""
import os
import platform
import subprocess
import sys

import pytest

from tupe_jax import allocator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLIBC = ("glibc", "2.36")


def test_a_plain_environment_gets_the_tunable_and_the_marker():
    env = allocator.tuned_environ({"PATH": "/bin"}, GLIBC, "madvise")
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", allocator.MARKER: "1"}


def test_other_tunables_are_kept_and_the_setting_appended():
    env = allocator.tuned_environ({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}, GLIBC, "always")
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=0:glibc.malloc.hugetlb=1"


@pytest.mark.parametrize("environ,libc,mode", [
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, GLIBC, "madvise"),     # the user chose a value
    ({"GLIBC_TUNABLES": "a.b=1:glibc.malloc.hugetlb=2"}, GLIBC, "madvise"),
    ({allocator.OPT_OUT: "0"}, GLIBC, "madvise"),                          # the opt-out
    ({allocator.MARKER: "1"}, GLIBC, "madvise"),                           # already re-executed: never twice
    ({}, ("glibc", "2.34"), "madvise"),                                    # the tunable came in 2.35
    ({}, ("", ""), "madvise"),                                             # musl & co: no glibc tunables
    ({}, ("glibc", "weird"), "madvise"),
    ({}, GLIBC, "never"),                                                  # the kernel has THP off
])
def test_nothing_is_done_when_it_does_not_apply(environ, libc, mode):
    assert allocator.tuned_environ(environ, libc, mode) is None


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert allocator.thp_mode(str(path)) == "madvise"
    assert allocator.thp_mode(str(tmp_path / "missing")) == ""


def test_maybe_reexec_replaces_the_process_with_the_same_argv_and_the_tunable():
    """A real exec: the script prints its PID, re-executes, and the second incarnation (same PID, same argv)
    sees the tunable; where it does not apply here, the script runs once, unchanged."""
    script = ("import os, sys; from tupe_jax import allocator; print('start', os.getpid(), sys.argv[1:], flush=True);"
              "allocator.maybe_reexec(); print('env', os.getpid(), os.environ.get('GLIBC_TUNABLES', ''))")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", allocator.MARKER, allocator.OPT_OUT)}
    proc = subprocess.run([sys.executable, "-c", script, "x", "--y=1"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    lines = proc.stdout.splitlines()
    applies = allocator.tuned_environ(env, platform.libc_ver(), allocator.thp_mode()) is not None
    pid = lines[0].split()[1]
    if applies:
        assert lines[0] == lines[1] and lines[0].endswith("['x', '--y=1']")   # started twice, same PID and argv
        assert lines[2] == f"env {pid} glibc.malloc.hugetlb=1"
    else:
        assert len(lines) == 2 and lines[1] == f"env {pid} "
