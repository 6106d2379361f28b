"""Where the test suite's time goes: `make test`'s pytest run with benchmarks/suite_events.py, summed by file.
Not a test.

    python benchmarks/suite_profile.py --json benchmarks/results_suite_profile_avx512_zen4_s53.json
    python benchmarks/suite_profile.py tests/test_head.py tests/test_model.py      # some files only

Runs the Makefile's pytest command (its workers, one test file per worker at a time, the suite's XLA flags from
tests/conftest.py, glibc's huge pages) on `tests` or the paths given, with a fresh TMPDIR and no
JAX_COMPILATION_CACHE_DIR of the caller's, so that the compilation cache starts empty as on a fresh clone. Reports
pytest's wall seconds; the tests' seconds summed over the workers (setup, call and teardown); JAX's duration events
in the workers, summed (count, seconds); and per test file its tests' seconds and, of those, the worker's tracing,
lowering, XLA compiles and compilation-cache reads (`jax_s`): the rest is running the programs, the processes the
tests start (their own compiles included) and everything else. Files and the slowest tests sorted by seconds.
Events can overlap (a function traced inside another's trace counts in both; compiles on several threads), so a
file's `jax_s` can exceed its seconds.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from outputs import refuse_missing_folder, write_json  # noqa: E402  pylint: disable=wrong-import-position

# jax.monitoring's duration events of compiling, by the name the report gives them
EVENTS = {"trace_s": "/jax/core/compile/jaxpr_trace_duration",
          "lower_s": "/jax/core/compile/jaxpr_to_mlir_module_duration",
          "compile_s": "/jax/core/compile/backend_compile_duration",
          "cache_read_s": "/jax/compilation_cache/cache_retrieval_time_sec"}


def run_suite(paths: list[str], workers: str, events: str, scratch: str) -> tuple[float, str]:
    """The Makefile's pytest on `paths`, the plugin writing to `events`, TMPDIR `scratch`: (wall s, last line)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    env.update(GLIBC_TUNABLES="glibc.malloc.hugetlb=1", TMPDIR=scratch, SUITE_EVENTS_DIR=events,
               PYTHONPATH=os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p))
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", workers, "--dist", "loadfile", "-p", "no:cacheprovider",
           "-p", "suite_events", *paths]
    print("running: " + shlex.join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          check=False)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return time.perf_counter() - t0, lines[-1] if lines else f"exit status {proc.returncode}"


def summarise(processes: list[dict], top: int = 30) -> dict:
    """The plugin's per-process files -> totals, per-file rows and the `top` slowest tests (module docstring)."""
    tests: dict = {}
    events: dict = collections.defaultdict(lambda: [0, 0.0])
    for data in processes:
        for nodeid, test in data["tests"].items():
            row = tests.setdefault(nodeid, {"s": 0.0, **{k: 0.0 for k in EVENTS}})
            row["s"] += test["s"]
            for key, name in EVENTS.items():
                row[key] += test["events"].get(name, 0.0)
        for name, (count, seconds) in data["events"].items():
            events[name][0] += count
            events[name][1] += seconds
    files: dict = {}
    for nodeid, test in tests.items():
        row = files.setdefault(nodeid.split("::")[0], {"tests": 0, "s": 0.0, **{k: 0.0 for k in EVENTS}})
        row["tests"] += 1
        for key in ("s", *EVENTS):
            row[key] += test[key]
    rnd = lambda row: {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}  # noqa: E731
    by_file = [{"file": f, **rnd(r), "jax_s": round(sum(r[k] for k in EVENTS), 4)}
               for f, r in sorted(files.items(), key=lambda kv: -kv[1]["s"])]
    slowest = [{"test": t, **rnd(r)} for t, r in sorted(tests.items(), key=lambda kv: -kv[1]["s"])[:top]]
    return {"processes": len(processes), "tests": len(tests),
            "test_s_summed": round(sum(t["s"] for t in tests.values()), 2),
            "jax_s_summed": {k: round(events[n][1], 4) for k, n in EVENTS.items()},
            "events": {n: [c, round(s, 2)] for n, (c, s) in sorted(events.items(), key=lambda kv: -kv[1][1])},
            "files": by_file, "slowest_tests": slowest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", default=["tests"], help="test files or folders (default: tests)")
    ap.add_argument("--workers", default="auto", help="pytest-xdist's -n (the Makefile's: auto, one per core)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    with tempfile.TemporaryDirectory(prefix="suite-profile-") as tmp:
        events, scratch = os.path.join(tmp, "events"), os.path.join(tmp, "tmp")
        os.mkdir(events)
        os.mkdir(scratch)
        wall, last = run_suite(args.paths, args.workers, events, scratch)
        processes = []
        for name in sorted(os.listdir(events)):
            with open(os.path.join(events, name), encoding="utf-8") as f:
                processes.append(json.load(f))
    out = {"command": "python benchmarks/suite_profile.py " + shlex.join(sys.argv[1:]), "result": last,
           "pytest_wall_s": round(wall, 2), **summarise(processes), "loadavg_after": list(os.getloadavg())}
    print(f"{last}; {wall:.0f} s of wall, {out['test_s_summed']:.0f} s of tests summed over {len(processes)} "
          f"processes, of which in the workers: " + ", ".join(f"{k} {v:.0f}" for k, v in out["jax_s_summed"].items()))
    for row in out["files"][:15]:
        print(f"  {row['s']:7.1f} s  jax {row['jax_s']:6.1f} s  {row['tests']:4d} tests  {row['file']}")
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
