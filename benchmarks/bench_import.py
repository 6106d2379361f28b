"""Start-up cost every process pays before it computes: importing ml_dtypes (jax's dtypes) and the pretraining
loop, for several ml_dtypes versions. Not a test.

    pip download --no-deps ml_dtypes==0.6.0 -d /tmp/w6 && (cd /tmp/w6 && unzip -q ml_dtypes-*.whl)
    python benchmarks/bench_import.py --rounds 9 --site installed --site /tmp/w6 \
        --json benchmarks/results_import_ml_dtypes_avx2_zen4.json

A site is `installed` (the environment as it is) or a folder holding another unpacked ml_dtypes wheel, put first
on sys.path. Each round runs every site once, in order, each in two fresh processes: one times `import ml_dtypes`
after numpy (what the extension's module init costs), the other `from tupe_jax.pretrain import loop` (the whole
import a `launch pretrain` pays). Medians over rounds with min, max and the median's 95% interval (`rounds.spread`).
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from outputs import refuse_below, refuse_missing_folder, write_json  # noqa: E402  pylint: disable=wrong-import-position
from rounds import spread  # noqa: E402  pylint: disable=wrong-import-position
from tupe_jax import host  # noqa: E402  pylint: disable=wrong-import-position

PROBES = {
    "ml_dtypes_s": "import numpy, time; t = time.perf_counter(); import ml_dtypes; s = time.perf_counter() - t",
    "pretrain_loop_s": "import time; t = time.perf_counter(); from tupe_jax.pretrain import loop; "
                       "s = time.perf_counter() - t; import ml_dtypes",
}


def measure(site: str, probe: str) -> tuple[float, str]:
    """Seconds of one probe in a fresh process, and the ml_dtypes version it imported."""
    prefix = "" if site == "installed" else f"import sys; sys.path.insert(0, {site!r}); "
    code = prefix + PROBES[probe] + "; print(s, ml_dtypes.__version__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    seconds, version = out.stdout.split()[-2:]
    return float(seconds), version


def numpy_version() -> str:
    import numpy  # pylint: disable=import-outside-toplevel
    return numpy.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--site", action="append", required=True)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    refuse_missing_folder(args.json)
    refuse_below(args, rounds=1)
    for site in args.site:
        if site != "installed" and not os.path.isdir(os.path.join(site, "ml_dtypes")):
            sys.exit(f"error: no ml_dtypes package in {site}, --site, give `installed` or an unpacked wheel's folder")
    times = {site: {probe: [] for probe in PROBES} for site in args.site}
    versions = {}
    for r in range(args.rounds):
        for site in args.site:
            for probe in PROBES:
                seconds, versions[site] = measure(site, probe)
                times[site][probe].append(seconds)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{versions[s]} {times[s]['ml_dtypes_s'][-1]:.3f}/{times[s]['pretrain_loop_s'][-1]:.2f} s"
            for s in args.site), flush=True)
    result = {"what": __doc__.split("\n")[0], "command": " ".join(["python", "benchmarks/bench_import.py"]
                                                                   + sys.argv[1:]),
              "machine": f"{host.cpu_kind()}, {os.cpu_count()} cores",
              "python": platform.python_version(), "numpy": numpy_version(),
              "sites": {site: {"ml_dtypes": versions[site], **{p: spread(v) for p, v in times[site].items()}}
                        for site in args.site}}
    write_json(args.json, result, newline=True)


if __name__ == "__main__":
    main()
