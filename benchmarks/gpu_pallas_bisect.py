"""On a GPU: which backward kernel of the pallas flash attention stalls XLA's compile, and in which stage. Not a test.

In session 22 the kernel's backward with attention dropout did not finish compiling on an H200 (jax 0.11.2) while
the forward compiled in 1.4 s and the backward without dropout in 0.55 s (RESULTS.md, GPU round 2). On CPU, the
same kernels' Triton IR (lowered for CUDA here) compiled with pip's Triton for sm_90 within seconds in a one-off
check (not kept as a file); there `flash_dkv` with dropout was the kernel at the register limit. So this script compiles
ONE backward kernel alone per case, in a subprocess under `--timeout`, with XLA dumping its LLVM IR, and reports
how far the compile got from the files XLA left:
  no LLVM file             -> stuck before LLVM (XLA's Triton pipeline: MLIR passes, Triton -> LLVM);
  *.ir-no-opt.ll only      -> stuck in LLVM's optimisation;
  *.ir-with-opt.ll, no ptx -> stuck in LLVM's NVPTX code generation;
  *.ptx                    -> stuck in ptxas.
A case is kernel:rate:num_stages:num_warps:block_q[:mask], e.g. dkv:0.1:2:4:64 (the code's settings) or
dkv:0.1:2:4:32 (a 32-query tile in dK/dV's loop: half the live tile of scores, probabilities and masks); mask is
where the dropout mask comes from (kernels/masks.py): in_kernel (hashed, the default; what stalled in session 22)
or precomputed (bytes drawn by XLA, the model's default since session 23).

    python benchmarks/gpu_pallas_bisect.py [--cases ...] [--timeout 40] [--json out.json]
    python benchmarks/gpu_pallas_bisect.py --interpret      # on CPU: checks the script itself
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outputs import refuse_missing_folder, write_json  # noqa: E402  pylint: disable=wrong-import-position
# the model's form first (the mask precomputed: what gpu_round2.sh's canary compiles), then 8 warps (no spill in
# benchmarks/triton_registers.py), 1 stage, and the form that stalled in session 22 (hashed in the kernel)
CASES = ("dkv:0.1:2:4:64:precomputed,dq:0.1:2:4:64:precomputed,dkv:0.1:2:8:64:precomputed,"
         "dkv:0.1:1:4:64:precomputed,dkv:0.1:2:4:64")
STAGES = (".ir-no-opt.ll", ".ir-with-opt.ll", ".ptx")


def compile_one(kernel: str, rate: float, stages: int, warps: int, block_q: int, interpret: bool,
                mask: str = "in_kernel") -> None:
    """Lower and compile one backward kernel on (1, 512, 1, 64) bf16 inputs; prints COMPILED <seconds>."""
    sys.path.insert(0, ROOT)
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from tupe_jax.dropout import keep_bits16  # pylint: disable=import-outside-toplevel
    from tupe_jax.kernels import calls, flash  # pylint: disable=import-outside-toplevel
    calls.NUM_STAGES, calls.NUM_WARPS = stages, warps
    batch, length, heads, dim = 1, 512, 1, 64
    q, k, v, do = (jax.random.normal(jax.random.PRNGKey(i), (batch, length, heads, dim), jnp.bfloat16)
                   for i in range(4))
    precomputed = mask == "precomputed" and rate > 0
    key = jax.random.key_data(jax.random.PRNGKey(1)).astype(jnp.uint32) if rate > 0 else None
    if precomputed:   # the kernel's source slot holds keep_bits16's bytes instead of the key's words
        key = keep_bits16(jax.random.PRNGKey(1), (batch, heads, length, length), 1.0 - rate)
    stats = jnp.zeros((batch, heads, length), jnp.float32)
    # pylint: disable=protected-access
    spec = flash._Spec(q, None, None, 0.125, rate, block_q, flash.BACKWARD_BLOCK_K, precomputed=precomputed)
    call = flash._dkv if kernel == "dkv" else flash._dq   # the calls `flash._backward` makes

    def backward_kernel(q, k, v, do, lse, delta):
        return call(spec, [q, k, v, None, None, key, do, lse, delta], interpret)

    start = time.perf_counter()
    jax.jit(backward_kernel).lower(q, k, v, do, stats, stats).compile()
    print("COMPILED", time.perf_counter() - start, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--timeout", type=float, default=40.0)
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--dump_root", default="/tmp/gpu_pallas_bisect")
    ap.add_argument("--json", default="")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    if args.child:
        kernel, rate, stages, warps, block_q, *mask = args.child.split(":")
        return compile_one(kernel, float(rate), int(stages), int(warps), int(block_q), args.interpret, *mask)
    rows = []
    for case in args.cases.split(","):
        dump = os.path.join(args.dump_root, case.replace(":", "_"))
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} "
                                         "--xla_gpu_dump_llvmir".strip())
        start = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", case]
                                  + (["--interpret"] if args.interpret else []), env=env, timeout=args.timeout,
                                  capture_output=True, text=True, check=False)
            status = "compiled" if "COMPILED" in done.stdout else f"error: {done.stderr.strip()[-300:]}"
        except subprocess.TimeoutExpired:
            status = "timeout"
        # the kernel's own module (jit(backward_kernel)), not the modules that made its random inputs
        names = [os.path.basename(x) for x in glob.glob(os.path.join(dump, "*jit_backward_kernel*"))]
        row = {"case": case, "status": status, "seconds": round(time.perf_counter() - start, 2),
               "dumped": {suffix: sum(n.endswith(suffix) for n in names) for suffix in STAGES},
               "dump_files": len(names)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:   # quietly: rewritten after every case
            write_json(args.json, {"timeout_s": args.timeout, "interpret": args.interpret, "rows": rows},
                       announce=False)
    return None


if __name__ == "__main__":
    main()
