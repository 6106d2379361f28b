"""Where HF torch's train step spends its time, op by op: `torch.profiler` over the step bench_train times. Not a test.

    python benchmarks/profile_torch_peer.py --slots 128 --steps 10 \
        --json benchmarks/results_profile_torch_peer_equal_work_avx512_zen4.json

The step is `train_workers.torch_peer` (HF `BertForMaskedLM`, the reference shape, dropout 0.1, torch's default
threads), warmed up, timed over `--steps` steps, then `--steps` steps under the profiler (the profiler's own cost
per op shows as the gap between the two step times), then one more step whose FLOPs the profiler counts (counting
costs more time, so the times come from the steps before). Per ATen op: its self CPU time per step (time on the
thread that called it, its children excluded; an op parallelised over torch's threads counts its wall time once)
and, for matrix products, its FLOPs per step as the profiler counts them. Each op is put in a kind:
- `matmul`: mm and addmm (the projections and the head), bmm and baddbmm (attention's products);
- `fused attention`: scaled_dot_product attention kernels, where torch runs one (with attention dropout in
  training, HF's sdpa path on CPU runs bmm, softmax and dropout instead);
- `optimizer`: `_foreach_*` ops (here AdamW and the clipping run per-tensor ops, which land in `other`);
- `other`: the rest (elementwise, reductions, copies, the dropout masks, the loss).
The JSON has every op, so the step can be set beside ours (`profile_step.py`).
"""
from __future__ import annotations

import argparse
import collections
import os
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from outputs import refuse_below, refuse_missing_folder, write_json  # noqa: E402  pylint: disable=wrong-import-position

MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}


def kind(name: str) -> str:
    """The kind of an ATen op (module docstring)."""
    if name in MATMULS:
        return "matmul"
    if "scaled_dot_product" in name:
        return "fused attention"
    if name.startswith("aten::_foreach"):
        return "optimizer"
    return "other"


def summarise(events, steps: int, wall_s: float, flops: dict) -> dict:
    """`torch.profiler` key averages over `steps` steps, and FLOPs per op for one step -> per-step ms and GFLOP by op
    and by kind."""
    ops = []
    for e in events:
        ms = e.self_cpu_time_total / 1e3 / steps
        if ms <= 0:
            continue
        ops.append({"op": e.key, "kind": kind(e.key), "ms": ms, "calls": e.count / steps,
                    "gflop": flops.get(e.key, 0) / 1e9})
    ops.sort(key=lambda o: -o["ms"])
    kinds = collections.defaultdict(lambda: {"ms": 0.0, "gflop": 0.0})
    for o in ops:
        kinds[o["kind"]]["ms"] += o["ms"]
        kinds[o["kind"]]["gflop"] += o["gflop"]
    for k in kinds.values():
        k["gflops_per_s"] = k["gflop"] / k["ms"] * 1e3 if k["gflop"] and k["ms"] else None
    return {"wall_ms_per_step": 1e3 * wall_s / steps, "self_ms_per_step": sum(o["ms"] for o in ops),
            "kinds": dict(kinds), "ops": ops}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=128, help="MLM slots per row (torch's head runs on all anyway)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    refuse_below(args, steps=1, warmup=0)
    import torch  # pylint: disable=import-outside-toplevel
    from torch.profiler import ProfilerActivity, profile  # pylint: disable=import-outside-toplevel
    from train_workers import shape as train_shape, torch_peer  # pylint: disable=import-outside-toplevel
    from tupe_jax.host import cpu_description  # pylint: disable=import-outside-toplevel

    shape = train_shape("small")
    step, model = torch_peer(shape, 0.1, args.slots)
    for i in range(args.warmup):
        print(f"warm-up step {i + 1}/{args.warmup}", flush=True)
        step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    plain = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as counted:   # FLOPs only: it costs more
        step()
    flops = {e.key: e.flops for e in counted.key_averages() if e.flops}
    out = {"command": "python benchmarks/profile_torch_peer.py " + shlex.join(sys.argv[1:]),
           "cpu_description": cpu_description(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "attention": model.config._attn_implementation,  # pylint: disable=protected-access
           "steps": args.steps, "unprofiled_wall_ms_per_step": 1e3 * plain / args.steps,
           **summarise(prof.key_averages(), args.steps, wall, flops)}
    print(f"wall {out['wall_ms_per_step']:.1f} ms/step under the profiler ({out['unprofiled_wall_ms_per_step']:.1f} "
          f"without); self CPU {out['self_ms_per_step']:.1f} ms")
    for name, k in sorted(out["kinds"].items(), key=lambda kv: -kv[1]["ms"]):
        rate = f", {k['gflops_per_s']:.0f} GFLOP/s" if k["gflops_per_s"] else ""
        print(f"  {name}: {k['ms']:.1f} ms, {k['gflop']:.2f} GFLOP{rate}")
    for o in out["ops"][:15]:
        print(f"  {o['op']}: {o['ms']:.1f} ms ({o['kind']})")
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
