"""XLA:CPU float32 matmul rate at the reference shape's projection sizes: the ceiling for any train step on this
machine (a step that ran only its matmuls, at these rates, could go no faster). Not a test.

    python benchmarks/bench_matmul.py --rounds 5 --json benchmarks/results_matmul_cpu.json

Shapes (M = batch 16 × length 128 = 2048 tokens; d 256, MLP 1024, vocab 8192): each projection's forward
(M, K) · (K, F), and its weight gradient Xᵀ · G over the long M axis as `projection.dense_dot_general` runs it
(the smaller operand's transpose materialised); plus a 2048³ square. One jitted dot per shape, `--steps` synced
calls per round; per shape the median over rounds of the per-round median, with its min–max (`rounds.spread`);
GFLOP/s = 2·M·K·F / s.

    python benchmarks/bench_matmul.py --attention --rounds 7 --json benchmarks/results_matmul_attention_<cpu>.json
    taskset -c 0 python benchmarks/bench_matmul.py --attention --rounds 7 --json …_1core.json

`--attention`: attention's batched products instead, at the same shape (batch 16 × 4 heads = 64 products of
length 128, head size 64) — S = Q·Kᵀ, O = P·V and ∂V = Pᵀ·∂O (∂P, ∂Q, ∂K have the same forms) — each run three
ways in every round: XLA with its default libraries, XLA with oneDNN for its dots (`xla_options.ONEDNN_DOTS`,
options for that executable alone) and torch's `bmm`; the qkv projection with XLA's defaults is the yardstick of
what a second core adds. Run it once as is and once under `taskset -c 0` to see which products use both cores
(the JSON records the cores the process may use).

    python benchmarks/bench_matmul.py --engines --rounds 15 --json benchmarks/results_matmul_engines_<cpu>.json

`--engines`: the projection shapes above run the same three ways (XLA's default, XLA with oneDNN dots, torch's
`mm`). With either flag the report adds, per product, torch's rate over XLA-with-oneDNN's within each round
(median over rounds, with its interval): how far the library the train step uses is from torch's on this CPU.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from outputs import refuse_below, refuse_missing_folder, write_json  # noqa: E402  pylint: disable=wrong-import-position
from rounds import rotated, spread  # noqa: E402  pylint: disable=wrong-import-position

SHAPES = {  # name: (M, K, F) of the product (M, K) · (K, F)
    "qkv forward (2048×256 · 256×768)": (2048, 256, 768),
    "mlp_in forward (2048×256 · 256×1024)": (2048, 256, 1024),
    "mlp_out forward (2048×1024 · 1024×256)": (2048, 1024, 256),
    "head forward (2048×256 · 256×8192)": (2048, 256, 8192),
    "mlp_in weight gradient (256×2048 · 2048×1024)": (256, 2048, 1024),
    "square 2048³": (2048, 2048, 2048),
}


BATCHED = {  # name: (lhs shape, rhs shape, lhs contracting dim, rhs contracting dim), batch dim 0; 64 = 16 × 4 heads
    "S = Q·Kᵀ (128×64 · 64×128)": ((64, 128, 64), (64, 128, 64), 2, 2),
    "O = P·V (128×128 · 128×64)": ((64, 128, 128), (64, 128, 64), 2, 1),
    "∂V = Pᵀ·∂O (128×128ᵀ · 128×64)": ((64, 128, 128), (64, 128, 64), 1, 1),
}


ONEDNN, TORCH = "XLA, oneDNN dots", "torch"


def xla_engines(name: str, product, a, b, calls: dict) -> None:
    """Add `product` (jitted) on a, b compiled with XLA's defaults and with oneDNN dots to `calls`."""
    import jax  # pylint: disable=import-outside-toplevel
    from tupe_jax.xla_options import ONEDNN_DOTS  # pylint: disable=import-outside-toplevel
    ja, jb = jax.numpy.asarray(a), jax.numpy.asarray(b)
    for engine, options in (("XLA", None), (ONEDNN, ONEDNN_DOTS)):
        compiled = product.lower(ja, jb).compile(options)
        calls[(name, engine)] = lambda c=compiled, x=ja, y=jb: c(x, y).block_until_ready()


def attention_products(rounds: int, steps: int) -> dict:
    """GFLOP/s per round of each batched product under each engine (module docstring), engines interleaved."""
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import torch  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(0)
    calls, flops = {}, {}
    for name, (ls, rs, lc, rc) in BATCHED.items():
        a, b = rng.standard_normal(ls, np.float32), rng.standard_normal(rs, np.float32)
        dims = (((lc,), (rc,)), ((0,), (0,)))
        flops[name] = 2 * ls[0] * ls[lc] * (ls[3 - lc]) * rs[3 - rc]
        xla_engines(name, jax.jit(lambda x, y, dims=dims: jax.lax.dot_general(x, y, dims)), a, b, calls)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)        # bmm takes (batch, m, k) · (batch, k, n) views
        ta, tb = (ta.transpose(1, 2) if lc == 1 else ta), (tb.transpose(1, 2) if rc == 2 else tb)
        calls[(name, f"{TORCH} bmm")] = lambda x=ta, y=tb: torch.bmm(x, y)
    m, k, f = SHAPES["qkv forward (2048×256 · 256×768)"]
    x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, f), np.float32)
    compiled = jax.jit(jax.numpy.dot).lower(x, w).compile()
    calls[("qkv projection (2048×256 · 256×768)", "XLA")] = lambda: compiled(x, w).block_until_ready()
    flops["qkv projection (2048×256 · 256×768)"] = 2 * m * k * f
    return timed_rounds(calls, flops, rounds, steps)


def projection_products(rounds: int, steps: int) -> dict:
    """GFLOP/s per round of each projection shape under XLA, XLA with oneDNN dots and torch's mm, interleaved."""
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import torch  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(0)
    calls, flops = {}, {}
    for name, (m, k, f) in SHAPES.items():
        a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, f), np.float32)
        flops[name] = 2 * m * k * f
        xla_engines(name, jax.jit(jax.numpy.dot), a, b, calls)
        calls[(name, TORCH)] = lambda x=torch.from_numpy(a), y=torch.from_numpy(b): torch.mm(x, y)
    return timed_rounds(calls, flops, rounds, steps)


def timed_rounds(calls: dict, flops: dict, rounds: int, steps: int) -> dict:
    """{"product | engine" ("product" where engine is None): GFLOP/s per round}: each call `steps` times a round
    (median), all calls in every round, after one untimed call each."""
    key = lambda name, engine: name if engine is None else f"{name} | {engine}"  # noqa: E731
    for call in calls.values():
        call()
    per = {key(name, engine): [] for name, engine in calls}
    for r in range(rounds):
        for (name, engine), call in rotated(calls.items(), r):
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            per[key(name, engine)].append(flops[name] / statistics.median(times) / 1e9)
        print(f"# round {r}: " + ", ".join(f"{v[-1]:.0f}" for v in per.values()) + " GFLOP/s", flush=True)
    return per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--attention", action="store_true", help="attention's batched products, three engines")
    ap.add_argument("--engines", action="store_true", help="the projection shapes under the same three engines")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    refuse_below(args, rounds=1, steps=1)
    if args.attention and args.engines:
        sys.exit("error: --attention and --engines together, the command line, give one of them")
    if args.attention or args.engines:
        load_before = os.getloadavg()
        products = attention_products if args.attention else projection_products
        return report(args, products(args.rounds, args.steps), load_before)
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    dot = jax.jit(jnp.dot)
    calls, flops = {}, {}
    for name, (m, k, f) in SHAPES.items():
        a = jax.random.normal(jax.random.PRNGKey(0), (m, k), jnp.float32)
        b = jax.random.normal(jax.random.PRNGKey(1), (k, f), jnp.float32)
        calls[(name, None)] = lambda a=a, b=b: dot(a, b).block_until_ready()
        flops[name] = 2 * m * k * f
    load_before = os.getloadavg()
    per = timed_rounds(calls, flops, args.rounds, args.steps)
    return report(args, per, load_before)


def report(args: argparse.Namespace, per: dict, load_before) -> None:
    """Print the table and write the JSON (`--json`)."""
    import jax  # pylint: disable=import-outside-toplevel
    from tupe_jax.host import cpu_description  # pylint: disable=import-outside-toplevel
    out = {"command": "python benchmarks/bench_matmul.py " + shlex.join(sys.argv[1:]), "jax": jax.__version__,
           "cpu": cpu_description(),
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "cpus": os.cpu_count(),
           "cores_allowed": sorted(os.sched_getaffinity(0)),
           "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
           "gflops_per_round": per,
           "gflops": {n: spread(v) for n, v in per.items()}}
    print(f"\n| product | engine ({len(os.sched_getaffinity(0))} cores) | GFLOP/s, median of rounds (min–max) |\n"
          "|---|---|---|")
    for name, g in out["gflops"].items():
        product, _, engine = name.partition(" | ")
        print(f"| {product} | {engine or 'XLA'} | {g['median']:.0f} ({g['min']:.0f}–{g['max']:.0f}) |")
    out["torch_over_onednn"] = torch_over_onednn(per)
    if out["torch_over_onednn"]:
        print("\n| product | torch ÷ XLA with oneDNN dots, per round: median (95% interval of the median; below 6 "
              "rounds, the min–max) |\n|---|---|")
        for name, r in out["torch_over_onednn"].items():
            low, high = r["ci95"] or (r["min"], r["max"])
            print(f"| {name} | {r['median']:.3f} ({low:.3f}–{high:.3f}) |")
    if args.json:
        write_json(args.json, out)


def torch_over_onednn(per: dict) -> dict:
    """Per product with both engines: torch's GFLOP/s over XLA-with-oneDNN's within each round, then `spread`."""
    out = {}
    for key, rates in per.items():
        product, _, engine = key.partition(" | ")
        if engine.startswith(TORCH) and f"{product} | {ONEDNN}" in per:
            out[product] = spread([t / o for t, o in zip(rates, per[f"{product} | {ONEDNN}"])])
    return out


if __name__ == "__main__":
    main()
