"""tupe_jax.allocator: which malloc `python -m launch` re-executes itself with (oneTBB's, kept blocks; glibc's huge
pages; neither), the refusals, and that the re-executed process really runs with it."""
import os
import platform
import subprocess
import sys

import pytest

from tupe_jax import allocator
from tupe_jax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLIBC = ("glibc", "2.36")
TBB = ("/site/lib/libtbbmalloc.so.2", "/site/lib/libtbbmalloc_proxy.so.2")


def test_a_plain_environment_gets_the_tunable_and_the_marker_without_tbb():
    env = allocator.tuned_environ({"PATH": "/bin"}, GLIBC, "madvise")
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", allocator.MARKER: "1"}


def test_with_tbb_installed_the_proxy_is_preloaded_after_its_allocator_and_blocks_are_kept():
    env = allocator.tuned_environ({"PATH": "/bin"}, GLIBC, "madvise", TBB)
    assert env == {"PATH": "/bin", "LD_PRELOAD": ":".join(TBB), allocator.MARKER: "1",
                   "TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD": "1048576"}
    assert allocator.active(env) == "tbbmalloc"


def test_other_tunables_are_kept_and_the_setting_appended():
    env = allocator.tuned_environ({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}, GLIBC, "always")
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=0:glibc.malloc.hugetlb=1"
    assert allocator.active(env) == "hugepages"


@pytest.mark.parametrize("environ,plugin,expected", [
    ({}, "", "tbbmalloc"),
    ({"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}, "", "hugepages"),     # the user's own malloc is kept
    ({}, "libtpu", "hugepages"),                                        # JAX may run on a TPU: unmeasured there
    ({}, "jax_plugins.xla_cuda12", "hugepages"),
    ({"JAX_PLATFORMS": "cpu"}, "libtpu", "tbbmalloc"),                  # ... unless it is told to run on the CPU
    ({"JAX_PLATFORMS": "tpu,cpu"}, "libtpu", "hugepages"),
    ({allocator.CHOICE: "tbbmalloc"}, "libtpu", "tbbmalloc"),              # named: the user chose it for that host
    ({allocator.CHOICE: "hugepages"}, "", "hugepages"),
    ({allocator.CHOICE: "auto"}, "", "tbbmalloc"),
    ({allocator.CHOICE: "system"}, "", ""),
    ({allocator.OPT_OUT: "0"}, "", ""),                                 # the older opt-out
    ({allocator.OPT_OUT: "0", allocator.CHOICE: "tbbmalloc"}, "", "tbbmalloc"),   # the named choice wins
    ({allocator.MARKER: "1"}, "", ""),                                  # already re-executed: never twice
])
def test_the_first_setting_that_applies_is_chosen(environ, plugin, expected):
    assert allocator.choose(environ, GLIBC, "madvise", TBB, plugin) == expected


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
def test_nothing_is_done_when_neither_applies(environ, libc, mode):
    assert allocator.tuned_environ(environ, libc, mode) is None


@pytest.mark.parametrize("environ,libs,message", [
    ({allocator.CHOICE: "jemalloc"}, TBB,
     "error: TUPE_JAX_ALLOCATOR='jemalloc' is not one of auto, tbbmalloc, hugepages, system, the environment"),
    ({allocator.CHOICE: "tbbmalloc"}, None,
     "error: TUPE_JAX_ALLOCATOR=tbbmalloc cannot apply: the tbb wheel (oneTBB's libtbbmalloc) is not installed"),
    ({allocator.CHOICE: "tbbmalloc", "LD_PRELOAD": "x.so"}, TBB,
     "error: TUPE_JAX_ALLOCATOR=tbbmalloc cannot apply: LD_PRELOAD is already set"),
    ({allocator.CHOICE: "hugepages", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, TBB,
     "error: TUPE_JAX_ALLOCATOR=hugepages cannot apply: GLIBC_TUNABLES already sets glibc.malloc.hugetlb"),
])
def test_a_choice_that_cannot_apply_is_one_line_naming_the_cause(environ, libs, message):
    with pytest.raises(UserError) as err:
        allocator.tuned_environ(environ, GLIBC, "madvise", libs)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_active_reads_the_environment():
    assert allocator.active({"LD_PRELOAD": "/a/libtbbmalloc.so.2:/a/libtbbmalloc_proxy.so.2"}) == "tbbmalloc"
    assert allocator.active({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}) == "hugepages"
    assert allocator.active({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == "system"
    assert allocator.active({}) == "system"


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert allocator.thp_mode(str(path)) == "madvise"
    assert allocator.thp_mode(str(tmp_path / "missing")) == ""


def test_the_installed_tbb_wheel_is_found_on_linux_x86_64():
    """setup.py installs `tbb` on Linux x86_64: its two libraries are found, as files, proxy last."""
    libs = allocator.tbbmalloc_libs()
    if not (sys.platform.startswith("linux") and platform.machine() == "x86_64"):
        pytest.skip("the tbb wheel is installed on Linux x86_64 only")
    assert libs is not None and [os.path.basename(p) for p in libs] == list(allocator.TBB_LIBS)
    assert all(os.path.isabs(p) and os.path.isfile(p) for p in libs)


def test_accelerator_plugin_finds_a_gpu_plugin_in_jax_plugins(tmp_path, monkeypatch):
    (tmp_path / "jax_plugins" / "xla_cuda12").mkdir(parents=True)
    monkeypatch.setattr(allocator.importlib.util, "find_spec",
                        lambda name: None if name == "libtpu" else _namespace(tmp_path / "jax_plugins"))
    assert allocator.accelerator_plugin() == "jax_plugins.xla_cuda12"


def _namespace(folder):
    class Spec:  # pylint: disable=too-few-public-methods
        submodule_search_locations = [str(folder)]
    return Spec()


def test_maybe_reexec_replaces_the_process_with_the_same_argv_and_the_allocator():
    """A real exec: the script prints its PID, re-executes, and the second incarnation (same PID, same argv)
    runs with what was chosen: with tbbmalloc its own memory map holds the proxy; where nothing applies here, the
    script runs once, unchanged."""
    script = ("import os, sys; from tupe_jax import allocator; print('start', os.getpid(), sys.argv[1:], flush=True);"
              "allocator.maybe_reexec(); print('env', os.getpid(), allocator.active());"
              "print('mapped', 'libtbbmalloc_proxy' in open('/proc/self/maps').read())")
    drop = allocator.SETTINGS_ENV
    env = {k: v for k, v in os.environ.items() if k not in drop}
    proc = subprocess.run([sys.executable, "-c", script, "x", "--y=1"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    lines = proc.stdout.splitlines()
    chosen = allocator.choose(env, platform.libc_ver(), allocator.thp_mode(), allocator.tbbmalloc_libs(),
                              allocator.accelerator_plugin())
    pid = lines[0].split()[1]
    if chosen:
        assert lines[0] == lines[1] and lines[0].endswith("['x', '--y=1']")   # started twice, same PID and argv
        assert lines[2:] == [f"env {pid} {chosen}", f"mapped {chosen == 'tbbmalloc'}"]
    else:
        assert lines[1:] == [f"env {pid} system", "mapped False"]


def test_a_bad_choice_stops_the_launcher_before_anything(tmp_path):
    env = {**os.environ, allocator.CHOICE: "jemalloc"}
    env.pop(allocator.MARKER, None)
    proc = subprocess.run([sys.executable, "-m", "launch", "demo", f"--workdir={tmp_path / 'run'}"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    if not sys.platform.startswith("linux"):
        pytest.skip("the launcher re-executes itself on Linux only")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: TUPE_JAX_ALLOCATOR='jemalloc' is not one of auto, tbbmalloc, hugepages, system, the environment, "
        "set TUPE_JAX_ALLOCATOR to one of them or unset it (tupe_jax/allocator.py)"]
    assert not (tmp_path / "run").exists()


FAULTS = """
import ctypes, resource
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(64 << 20)
    ctypes.memset(block, 1, 64 << 20)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults)
"""


def test_under_tbbmalloc_a_freed_large_block_is_reused_without_faulting_again():
    """What the setting is for: a 64 MiB block written, freed and allocated again (as XLA:CPU's per-step buffer)
    faults its pages in once under the launcher's tbbmalloc setting; with the system's malloc, again every time
    (at least one fault per 2 MiB page)."""
    libs = allocator.tbbmalloc_libs()
    if libs is None or not sys.platform.startswith("linux"):
        pytest.skip("the tbb wheel is installed on Linux x86_64 only")
    drop = allocator.SETTINGS_ENV
    plain = {k: v for k, v in os.environ.items() if k not in drop}
    tuned = allocator.tuned_environ({**plain, allocator.CHOICE: "tbbmalloc"}, GLIBC, "madvise", libs)

    def faults(env):
        out = subprocess.run([sys.executable, "-c", FAULTS], env=env, capture_output=True, text=True, timeout=60,
                             check=True).stdout
        return [int(n) for n in out.strip().strip("[]").split(",")]
    kept, system = faults(tuned), faults(plain)
    assert kept[0] >= 32 and max(kept[1:]) <= 8, kept
    assert min(system[1:]) >= 32, system
