"""CPU only: registers per thread and spill bytes that each Triton kernel of `kernels/flash.py` needs when compiled for
an H100/H200 (sm_90). Not a test.

The gradient w.r.t. (q, k, v, bias) of BERT-base attention (bf16 q, k, v (4, 512, 12, 64), a float32 bias
(1, 12, 512, 512), no mask, scale 0.125, block_q 64, block_k 128) is lowered for CUDA against an abstract H200, so
that all four kernels appear: forward, dK/dV, dQ, dbias. Each `__gpu$xla.gpu.triton` custom call carries its
kernel's Triton IR as MLIR bytecode (`ir` in its mhlo.backend_config, with num_warps and num_stages); jaxlib's own
MLIR reads it back to text, and pip's `triton` compiles that text for cuda capability 90 with the same num_warps
and num_stages. Registers and spills are read from the bundled ptxas' `-v` log, shared memory from the kernel's
metadata. Rows: dropout 0.1 with the mask precomputed (keep_bits) or hashed in the kernels (key), and dropout 0.
Triton's passes and ptxas are pip triton's, not the XLA build's that a GPU run uses: the numbers show register
pressure, not what a given jax release compiles to.

    .venv/bin/python -m pip install --no-deps --target /tmp/triton39 triton==3.9.0     # triton 3.9.0 was used
    .venv/bin/python benchmarks/triton_registers.py --triton-path /tmp/triton39 --warps 4,8 \\
        --json benchmarks/results_triton_registers_sm90.json
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outputs import refuse_missing_folder, write_json  # noqa: E402  pylint: disable=wrong-import-position

SHAPE, BIAS_SHAPE = (4, 512, 12, 64), (1, 12, 512, 512)
SCALE, BLOCK_Q, BLOCK_K, CAPABILITY = 0.125, 64, 128, 90
CASES = (("precomputed", 0.1), ("in_kernel", 0.1), ("none", 0.0))   # (mask mode, dropout rate)


def lowered_module(mode: str, rate: float):
    """The StableHLO module of the (q, k, v, bias) gradient, lowered for CUDA on an abstract H200."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from tupe_jax.dropout import keep_bits16  # pylint: disable=import-outside-toplevel
    from tupe_jax.kernels import flash  # pylint: disable=import-outside-toplevel

    def loss(q, k, v, bias, key):
        bits = keep_bits16(key, (SHAPE[0], SHAPE[2], SHAPE[1], SHAPE[1]), 1 - rate) if mode == "precomputed" else None
        out = flash.flash_attention(q, k, v, bias, None, key if mode == "in_kernel" else None, keep_bits=bits,
                                    scale=SCALE, dropout_rate=rate, block_q=BLOCK_Q, block_k=BLOCK_K)
        return jnp.sum(out.astype(jnp.float32))

    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    qkv = jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16)
    args = (qkv, qkv, qkv, jax.ShapeDtypeStruct(BIAS_SHAPE, jnp.float32), jax.ShapeDtypeStruct((2,), jnp.uint32))
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(jax.grad(loss, (0, 1, 2, 3))).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.compiler_ir("stablehlo")


def triton_calls(op) -> list:
    """The `__gpu$xla.gpu.triton` custom calls under `op`, in program order."""
    found = []
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                child = child.operation
                if child.name == "stablehlo.custom_call" and "xla.gpu.triton" in str(child.attributes["call_target_name"]):
                    found.append(child)
                found.extend(triton_calls(child))
    return found


def kernel_source(call) -> dict:
    """A custom call's kernel: name, launch settings, grid and its Triton IR as text (jaxlib's MLIR reads the
    bytecode, with the Triton dialect that Pallas lowers to)."""
    from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
    from jax._src.pallas.triton import lowering  # pylint: disable=import-outside-toplevel
    config = call.attributes["mhlo.backend_config"]
    with lowering._new_ir_context(), ir.Location.unknown():   # pylint: disable=protected-access
        text = ir.Module.parse(config["ir"].value_bytes).operation.get_asm()
    number = {k: ir.IntegerAttr(config[k]).value for k in ("num_warps", "num_stages", "grid_x", "grid_y", "grid_z")}
    return dict(name=ir.StringAttr(config["name"]).value, text=text, **number)


def ptxas_numbers(log: str) -> dict:
    """Registers, spill bytes and the stack frame from ptxas' `-v` log."""
    def first(pattern: str) -> int | None:
        match = re.search(pattern, log)
        return int(match.group(1)) if match else None
    return dict(registers=first(r"Used (\d+) registers"), spill_stores_bytes=first(r"(\d+) bytes spill stores"),
                spill_loads_bytes=first(r"(\d+) bytes spill loads"), stack_frame_bytes=first(r"(\d+) bytes stack frame"))


def compile_for_sm90(source: dict, workdir: str) -> dict:
    """Compiles one kernel's Triton IR with pip's triton for cuda capability 90; ptxas' numbers and the time."""
    import triton  # pylint: disable=import-outside-toplevel
    from triton import knobs  # pylint: disable=import-outside-toplevel
    from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel
    path = os.path.join(workdir, source["name"] + ".ttir")
    with open(path, "w", encoding="utf-8") as f:
        f.write(source["text"])
    knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = True, True   # ptxas runs and prints its log
    log, start = io.StringIO(), time.perf_counter()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(path, target=GPUTarget("cuda", CAPABILITY, 32),
                                options=dict(num_warps=source["num_warps"], num_stages=source["num_stages"]))
    seconds = time.perf_counter() - start
    return dict(ptxas_numbers(log.getvalue()), shared_memory_bytes=kernel.metadata.shared,
                compile_seconds=round(seconds, 2))


def kernel_sources(warps: list[int]) -> list[tuple[str, float, dict]]:
    """(mode, rate, kernel source) of every case's kernels at each of `warps` (calls.NUM_WARPS), all read before pip
    triton (its own MLIR) is imported."""
    from tupe_jax.kernels import calls  # pylint: disable=import-outside-toplevel
    sources = []
    for num_warps in warps:
        calls.NUM_WARPS = num_warps
        for mode, rate in CASES:
            module = lowered_module(mode, rate)     # kept alive while its ops are read
            sources += [(mode, rate, kernel_source(call)) for call in triton_calls(module.operation)]
    return sources


def measure(mode: str, rate: float, source: dict, workdir: str) -> dict:
    """One kernel's row, printed as it ends."""
    row = dict(mode=mode, dropout_rate=rate, kernel=source["name"].removeprefix("flash_"), triton_name=source["name"],
               num_warps=source["num_warps"], num_stages=source["num_stages"],
               grid=[source["grid_x"], source["grid_y"], source["grid_z"]], **compile_for_sm90(source, workdir))
    print(f"{mode:12s} rate {rate:<4} {row['kernel']:8s} {row['registers']} registers, spills "
          f"{row['spill_stores_bytes']}/{row['spill_loads_bytes']} B (stores/loads), "
          f"smem {row['shared_memory_bytes']} B, {row['compile_seconds']} s", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="", help="where to write the results")
    ap.add_argument("--triton-path", default="", help="a `pip install --target` folder holding triton")
    ap.add_argument("--warps", default="4", help="comma-separated num_warps to lower with (calls.NUM_WARPS: 4)")
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    if args.triton_path:
        sys.path.insert(0, args.triton_path)
    import jax  # pylint: disable=import-outside-toplevel
    from tupe_jax import host  # pylint: disable=import-outside-toplevel
    sources = kernel_sources([int(w) for w in args.warps.split(",")])
    with tempfile.TemporaryDirectory() as workdir:
        os.environ["TRITON_CACHE_DIR"] = os.path.join(workdir, "cache")
        os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # triton 3.9's default, without its warning
        import triton  # pylint: disable=import-outside-toplevel
        from triton.backends.nvidia.compiler import get_ptxas  # pylint: disable=import-outside-toplevel
        rows = [measure(mode, rate, source, workdir) for mode, rate, source in sources]
    result = dict(command="python " + shlex.join(sys.argv), jax=jax.__version__, triton=triton.__version__,
                  ptxas=get_ptxas(CAPABILITY).version,
                  target=f"cuda sm_{CAPABILITY}", cpu=host.cpu_description(), shape=dict(
                      qkv=list(SHAPE), bias=list(BIAS_SHAPE), scale=SCALE, block_q=BLOCK_Q, block_k=BLOCK_K),
                  rows=rows)
    if args.json:
        write_json(args.json, result, newline=True)


if __name__ == "__main__":
    main()
