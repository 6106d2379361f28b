"""The XLA flags of the suite (tests/conftest.py) and of the processes its tests start: one place.

-O0 for XLA's LLVM backend: compiling is most of a test's time, and -O0 halves it (test_model + test_kernels:
378 -> 177 s on 2 cores, benchmarks/results_suite_time_avx2.json). The optimised HLO is the same, only the machine
code (and so the last bit of some sums) differs. The golden run is compared bitwise to a recording made at the same
flags: at XLA's default level for the primary recording, at these flags for the every-scheme test (each in its own
process: tests/behaviour.py `record_at`).

XLA:CPU's older loop emitters instead of its MLIR fusion emitters (`--xla_cpu_use_fusion_emitters=false`): the
same HLO, emitted in less time: a tiny 2-layer `launch pretrain` compiles in 3.9 s instead of 6.1 s (medians of 5
interleaved rounds, benchmarks/results_compile_flags_avx2_zen4.json). Like -O0 it changes only the machine code.

On a loaded 2-core machine a collective can wait far longer than XLA's default 40 s before every fake device
reaches it, so the termination timeout is raised (it only ever aborts, never helps).
"""
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
COLLECTIVE_TIMEOUTS = ("--xla_cpu_collective_call_terminate_timeout_seconds=900 "
                       "--xla_cpu_collective_call_warn_stuck_timeout_seconds=300")


def devices(count: int) -> str:
    """XLA_FLAGS for a process with `count` fake CPU devices that compiles as the suite does."""
    return f"--xla_force_host_platform_device_count={count} {COLLECTIVE_TIMEOUTS} {FAST_COMPILE}"


SUITE = devices(8)
