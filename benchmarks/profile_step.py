"""Where the train step's time goes, op by op: a `jax.profiler` trace of the real step read against its optimised
HLO. Not a test.

    python benchmarks/profile_step.py --slots 128 --steps 5 --json benchmarks/results_profile_equal_work_avx2.json

Builds the step as `bench_levers.build` does (bert_a, `size=small`, dropout 0.1; `--slots` 128 = equal work with
HF, 20 = the default head), compiles it, traces `--steps` synced steps and sums, per step, the time XLA's CPU
threads spent in each HLO instruction (a top-level event per thread; events nested in one are not counted twice).
Each instruction is labelled from the optimised HLO:
- kind: `matmul` (the instruction is a dot or a fusion whose computation holds one), `reduction`, `rng` (its
  op_name names threefry: the dropout masks' hash where XLA did not fuse it into other ops), `loop` (a while
  instruction's own events; its body's instructions count on their own), `layout` (only copies, transposes,
  bitcasts, slices, concatenations), `elementwise` (the rest);
- where: its `op_name` with the layer index dropped (`forward`/`backward` for `jvp(...)`/`transpose(jvp(...))`;
  `outside the model` for the loss, the clipping and AdamW);
- for a matmul, its FLOPs (2 · output elements · contracted size, times the runs of its computation per step: a
  while body's trip count; the `while` itself counts none) and so its rate.
Two threads can run two instructions at once, so each instruction gets two times: busy (its own duration, summed
over threads) and its wall share (each moment split evenly between the instructions running then; the shares sum
to the wall time some instruction covered). A matmul's rate is over its wall share: what the machine did while it
ran. Some plain dots run asynchronously on XLA:CPU (the event is the launch): `summarise` marks them and leaves them
out of the rates. The JSON has every instruction.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import math
import os
import re
import shlex
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from outputs import refuse_below, refuse_missing_folder, write_json  # noqa: E402  pylint: disable=wrong-import-position

LAYOUT_OPS = {"copy", "transpose", "bitcast", "reshape", "slice", "concatenate", "broadcast", "pad", "tuple",
              "get-tuple-element", "parameter", "constant", "dynamic-slice", "dynamic-update-slice", "iota"}
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_COMP = re.compile(r"^(ENTRY )?%(\S+) .*\{\s*$")
DISPATCH_FRACTION = 1 / 3     # a matmul event shorter than this share of its work's time is only its launch
_CALLS = re.compile(r"(?:calls|body|condition|to_apply)=%([\w.\-]+)")


# ======================================================================================================= HLO
def parse_hlo(text: str) -> dict:
    """Optimised HLO text -> {"shapes": name -> dims, "ops": name -> (opcode, operands, attrs), "comps":
    computation -> [instruction names], "entry": the entry computation}. Names are unique in a module."""
    shapes, ops, comps, current, entry = {}, {}, {}, None, None
    for line in text.split("\n"):
        head = _COMP.match(line)
        if head and " = " not in line.split("{")[0]:
            current = head.group(2)
            comps[current] = []
            entry = current if head.group(1) else entry
            continue
        m = _INSTR.match(line)
        if not m or current is None:
            continue
        name, shape, opcode, rest = m.groups()
        dims = re.match(r"[a-z0-9]+\[([\d,]*)\]", shape)
        shapes[name] = [int(d) for d in dims.group(1).split(",") if d] if dims else None
        operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
        ops[name] = (opcode, operands, rest)
        comps[current].append(name)
    runs = {}   # computation -> times it runs per execution of the step: a while body runs its trip count times
    for _ in range(4):                       # nested loops: repeat until the products settle
        for comp, names in comps.items():
            for name in names:
                opcode, _, attrs = ops[name]
                body = re.search(r"body=%([\w.\-]+)", attrs)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
                if opcode == "while" and body and trips:
                    runs[body.group(1)] = runs.get(comp, 1) * int(trips.group(1))
    return {"shapes": shapes, "ops": ops, "comps": comps, "entry": entry, "runs": runs,
            "home": {name: comp for comp, names in comps.items() for name in names}}


def dot_flops(hlo: dict, name: str) -> int:
    """2 · output elements · contracted size of the dot `name` (batch dimensions count once, in the output)."""
    _, operands, attrs = hlo["ops"][name]
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
    lhs = hlo["shapes"][operands[0]]
    k = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d) if contracting else 1
    return 2 * math.prod(hlo["shapes"][name]) * k


def called(hlo: dict, name: str) -> list[str]:
    """Every instruction in the computations `name` calls, transitively."""
    out, todo, seen = [], [name], set()
    while todo:
        attrs = hlo["ops"][todo.pop()][2]
        for comp in _CALLS.findall(attrs):
            if comp not in seen and comp in hlo["comps"]:
                seen.add(comp)
                out.extend(hlo["comps"][comp])
                todo.extend(hlo["comps"][comp])
    return out


def describe(hlo: dict, name: str) -> dict:
    """kind, where and FLOPs of one top-level instruction (see the module docstring)."""
    opcode, _, attrs = hlo["ops"][name]
    inner = [name] + called(hlo, name)
    opcodes = {hlo["ops"][n][0] for n in inner}
    # a while loop's body instructions are traced (and counted) on their own, once per iteration: the loop's own
    # event holds none of their work, and each of them does its FLOPs as many times as its body runs
    flops = 0 if opcode == "while" else hlo["runs"].get(hlo["home"].get(name), 1) * sum(
        dot_flops(hlo, n) for n in inner if hlo["ops"][n][0] == "dot")
    if flops:
        kind = "matmul"
    elif "threefry" in attrs:
        kind = "rng"
    elif opcode == "while":
        kind = "loop"
    elif opcodes & {"reduce", "reduce-window"}:
        kind = "reduction"
    elif opcodes <= LAYOUT_OPS | {"fusion"}:
        kind = "layout"
    else:
        kind = "elementwise"
    op_name = re.search(r'op_name="([^"]+)"', attrs)
    return {"kind": kind, "where": where(op_name.group(1) if op_name else ""), "flops": flops}


def where(op_name: str) -> str:
    """A readable place for an `op_name`: forward/backward, the module path without layer indices."""
    path = re.sub(r"blocks_\d+", "blocks_*", op_name.replace("jit(train_step)/", ""))
    if "TransformerLM" not in path:
        return "outside the model (loss, clip, AdamW)"
    side = "backward" if path.startswith("transpose(") else "forward"
    path = re.sub(r"^(transpose\()?jvp\(TransformerLM\)\)?/", "", path)
    return f"{side} {path}"


# ===================================================================================================== trace
def busy_per_instruction(trace: dict, steps: int) -> tuple[dict, dict]:
    """trace.json -> (busy, share): instruction name -> ms per step on XLA's CPU threads (top-level events only),
    and its share of the wall clock (each moment split evenly between the instructions running at that moment)."""
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    per_thread = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and str(threads.get((e["pid"], e["tid"]), "")).startswith("tf_XLA"):
            if not e["name"].startswith(("ThunkExecutor", "SlinkyThreadPool")):
                per_thread[(e["pid"], e["tid"])].append(e)
    top = []
    for events in per_thread.values():
        end = -1.0
        for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            if e["ts"] >= end:               # not nested in the previous top-level event
                top.append(e)
                end = e["ts"] + e["dur"]
    busy, share = collections.defaultdict(float), collections.defaultdict(float)
    bounds = sorted([(e["ts"], 1, i) for i, e in enumerate(top)] + [(e["ts"] + e["dur"], 0, i)
                                                                    for i, e in enumerate(top)])
    active, last = set(), 0.0
    for t, starts, i in bounds:
        for j in active:
            share[top[j]["name"]] += (t - last) / len(active) / 1e3 / steps
        last = t
        (active.add if starts else active.discard)(i)
    for e in top:
        busy[e["name"]] += e["dur"] / 1e3 / steps
    return dict(busy), dict(share)


def summarise(hlo: dict, busy: dict, share: dict) -> dict:
    """Per-instruction rows (busy ms, wall-share ms, kind, place, FLOPs) and their sums per kind and per matmul
    place; a matmul's rate is taken over its wall share (what the whole machine did while it ran). A matmul whose
    event lasted under a third of what its FLOPs take at the step's own matmul rate is `dispatch_only` (XLA:CPU
    runs some plain dots asynchronously: the event is the launch, the work runs untraced beside other
    instructions); those are left out of the per-place rates and summed apart."""
    rows = [{"instruction": name, "ms": ms, "wall_share_ms": share.get(name, 0.0), **describe(hlo, name)}
            for name, ms in busy.items() if name in hlo["ops"]]
    rows.sort(key=lambda r: -r["wall_share_ms"])
    matmuls = [r for r in rows if r["kind"] == "matmul"]
    rate = sum(r["flops"] for r in matmuls) / max(sum(r["wall_share_ms"] for r in matmuls), 1e-9)   # FLOP per ms
    for r in rows:
        # no matmul of the step runs at 3x the step's average matmul rate (the fastest run ~1.2x on the machines
        # seen); a launch does (session 12's AVX-512 VM: 0.41 ms events for 3 ms of work, under a tenth elsewhere)
        r["dispatch_only"] = r["kind"] == "matmul" and r["ms"] < DISPATCH_FRACTION * r["flops"] / rate
    kinds = collections.defaultdict(lambda: [0.0, 0.0])
    places = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        kinds[r["kind"]][0] += r["ms"]
        kinds[r["kind"]][1] += r["wall_share_ms"]
        if r["kind"] == "matmul" and not r["dispatch_only"]:
            place = places[r["where"]]
            place[0] += r["ms"]
            place[1] += r["wall_share_ms"]
            place[2] += r["flops"]
    untimed = [r for r in rows if r["dispatch_only"]]
    return {"busy_ms_per_step": sum(r["ms"] for r in rows),
            "covered_wall_ms_per_step": sum(r["wall_share_ms"] for r in rows),
            "matmul_gflop_per_step": sum(r["flops"] for r in matmuls) / 1e9,
            "dispatch_only": {"instructions": len(untimed), "gflop": sum(r["flops"] for r in untimed) / 1e9,
                              "places": sorted({r["where"] for r in untimed})},
            "kinds": {k: {"ms": v[0], "wall_share_ms": v[1]} for k, v in sorted(kinds.items(), key=lambda kv: -kv[1][1])},
            "matmuls": {k: {"ms": v[0], "wall_share_ms": v[1], "gflop": v[2] / 1e9,
                            "gflops_per_s": v[2] / v[1] / 1e6 if v[1] else 0.0}
                        for k, v in sorted(places.items(), key=lambda kv: -kv[1][1])},
            "instructions": rows}


# ====================================================================================================== main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--peer", action="store_true", help="profile the HF Flax peer's step (bench_levers."
                    "build_hf_flax: dense logits over every position) instead of ours")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    refuse_below(args, steps=1)
    import jax  # pylint: disable=import-outside-toplevel
    from bench_levers import build, build_hf_flax, run  # pylint: disable=import-outside-toplevel
    from tupe_jax.host import cpu_description, cpu_kind  # pylint: disable=import-outside-toplevel
    variant = build_hf_flax(args.slots) if args.peer else build(args.slots)
    jitted = variant.get("jitted", variant["step"])
    hlo = parse_hlo(jitted.lower(variant["state"], variant["batches"][0]).compile().as_text())
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        t0 = time.perf_counter()
        wall = run(variant, args.steps)
        elapsed = time.perf_counter() - t0
        jax.profiler.stop_trace()
        trace = json.load(gzip.open(glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)[0]))
    out = {"command": "python benchmarks/profile_step.py " + shlex.join(sys.argv[1:]), "slots": args.slots,
           "step": "HF FlaxBertForMaskedLM" if args.peer else "ours (bert_a)",
           "cpu": cpu_kind(), "cpu_description": cpu_description(), "jax": jax.__version__, "wall_ms_per_step_median": 1e3 * wall,
           "wall_ms_per_step_mean": 1e3 * elapsed / args.steps,
           **summarise(hlo, *busy_per_instruction(trace, args.steps))}
    print(f"wall {out['wall_ms_per_step_median']:.0f} ms/step (median of {args.steps}); XLA threads busy "
          f"{out['busy_ms_per_step']:.0f} ms/step, covering {out['covered_wall_ms_per_step']:.0f} ms of wall\n\n"
          "| kind | busy ms/step | wall share ms/step | share of covered wall |\n|---|---:|---:|---:|")
    for kind, k in out["kinds"].items():
        print(f"| {kind} | {k['ms']:.1f} | {k['wall_share_ms']:.1f} | "
              f"{100 * k['wall_share_ms'] / out['covered_wall_ms_per_step']:.1f}% |")
    print("\n| matmuls at | busy ms/step | wall share ms/step | GFLOP | GFLOP/s over the wall share |\n"
          "|---|---:|---:|---:|---:|")
    for place, m in out["matmuls"].items():
        print(f"| {place} | {m['ms']:.1f} | {m['wall_share_ms']:.1f} | {m['gflop']:.2f} | {m['gflops_per_s']:.1f} |")
    d = out["dispatch_only"]
    print(f"\nmatmul FLOPs {out['matmul_gflop_per_step']:.2f} GFLOP/step; dispatch only (work untraced): "
          f"{d['instructions']} instructions, {d['gflop']:.2f} GFLOP ({', '.join(d['places']) or '-'})")
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
