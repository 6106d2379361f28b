"""XLA:CPU float32 matmul rate at the reference shape's projection sizes: the ceiling for any train step on this
machine (a step that ran only its matmuls, at these rates, could go no faster). Not a test.

    python benchmarks/bench_matmul.py --rounds 5 --json benchmarks/results_matmul_cpu.json

Shapes (M = batch 16 × length 128 = 2048 tokens; d 256, MLP 1024, vocab 8192): each projection's forward
(M, K) · (K, F), and its weight gradient Xᵀ · G over the long M axis as `projection.dense_dot_general` runs it
(the smaller operand's transpose materialised); plus a 2048³ square. One jitted dot per shape, `--steps` synced
calls per round; per shape the median over rounds of the per-round median, with its min–max (`rounds.spread`);
GFLOP/s = 2·M·K·F / s.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from rounds import spread  # noqa: E402  pylint: disable=wrong-import-position

SHAPES = {  # name: (M, K, F) of the product (M, K) · (K, F)
    "qkv forward (2048×256 · 256×768)": (2048, 256, 768),
    "mlp_in forward (2048×256 · 256×1024)": (2048, 256, 1024),
    "mlp_out forward (2048×1024 · 1024×256)": (2048, 1024, 256),
    "head forward (2048×256 · 256×8192)": (2048, 256, 8192),
    "mlp_in weight gradient (256×2048 · 2048×1024)": (256, 2048, 1024),
    "square 2048³": (2048, 2048, 2048),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    dot = jax.jit(jnp.dot)
    operands = {}
    for name, (m, k, f) in SHAPES.items():
        a = jax.random.normal(jax.random.PRNGKey(0), (m, k), jnp.float32)
        b = jax.random.normal(jax.random.PRNGKey(1), (k, f), jnp.float32)
        dot(a, b).block_until_ready()
        operands[name] = (a, b)
    load_before = os.getloadavg()
    per = {name: [] for name in SHAPES}
    for r in range(args.rounds):
        for name, (a, b) in operands.items():
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                dot(a, b).block_until_ready()
                times.append(time.perf_counter() - t0)
            m, k, f = SHAPES[name]
            per[name].append(2 * m * k * f / statistics.median(times) / 1e9)
        print(f"# round {r}: " + ", ".join(f"{v[-1]:.0f}" for v in per.values()) + " GFLOP/s", flush=True)
    from tupe_jax.host import cpu_description  # pylint: disable=import-outside-toplevel
    out = {"command": "python benchmarks/bench_matmul.py " + shlex.join(sys.argv[1:]), "jax": jax.__version__,
           "cpu": cpu_description(),
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "cpus": os.cpu_count(),
           "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
           "gflops_per_round": per,
           "gflops": {n: spread(v) for n, v in per.items()}}
    print("\n| product | GFLOP/s, median of rounds (min–max) |\n|---|---|")
    for name, g in out["gflops"].items():
        print(f"| {name} | {g['median']:.0f} ({g['min']:.0f}–{g['max']:.0f}) |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
