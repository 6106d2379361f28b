"""On a GPU: where the pallas kernel's time goes, phase by phase (lower, compile, run; forward, then backward), on
one small input, each line printed as it ends, so a run cut off by its timeout still says which phase hung. Not a
test. `python benchmarks/gpu_pallas_phases.py [--length 512] [--heads 1] [--rate 0.1] [--dropout_mask precomputed]
[--json out.json]` (the mask: precomputed bytes, the default, or hashed in the kernels: kernels/masks.py)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outputs import refuse_missing_folder, write_json  # noqa: E402  pylint: disable=wrong-import-position


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rate", type=float, default=0.1)
    ap.add_argument("--bias", action="store_true")
    ap.add_argument("--dropout_mask", choices=("precomputed", "in_kernel"), default="precomputed")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from tupe_jax.dropout import keep_bits16  # pylint: disable=import-outside-toplevel
    from tupe_jax.kernels import flash  # pylint: disable=import-outside-toplevel
    rows = []

    def note(phase: str, seconds: float, **extra) -> None:
        rows.append(dict(phase=phase, seconds=seconds, **extra))
        print(json.dumps(rows[-1]), flush=True)
        if args.json:   # quietly: rewritten after every phase
            write_json(args.json, {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                                   "args": vars(args), "rows": rows}, announce=False)

    shape = (args.batch, args.length, args.heads, 64)
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), shape, jnp.bfloat16) for i in range(3))
    bias = jax.random.normal(jax.random.PRNGKey(3), (1, args.heads, args.length, args.length)) if args.bias else None

    def fwd(q, k, v, bias):
        key, bits = jax.random.PRNGKey(1), None
        if args.dropout_mask == "precomputed" and args.rate > 0:     # drawn by XLA in the step, as the model does
            key, bits = None, keep_bits16(key, (args.batch, args.heads, args.length, args.length), 1.0 - args.rate)
        return flash.flash_attention(q, k, v, bias, None, key, keep_bits=bits, scale=0.125,
                                     dropout_rate=args.rate,
                                     interpret=jax.default_backend() != "gpu").astype(jnp.float32).sum()

    argnums = (0, 1, 2, 3) if args.bias else (0, 1, 2)      # with --bias the backward holds the dbias kernel too
    for name, fn in (("forward", jax.jit(fwd)), ("backward", jax.jit(jax.grad(fwd, argnums=argnums)))):
        t = time.perf_counter()
        lowered = fn.lower(q, k, v, bias)
        note(f"{name} lower", time.perf_counter() - t, triton_calls=lowered.as_text().count(flash.TRITON_CALL))
        t = time.perf_counter()
        compiled = lowered.compile()
        note(f"{name} compile", time.perf_counter() - t)
        for i in range(3):
            t = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v, bias))
            note(f"{name} run {i}", time.perf_counter() - t)


if __name__ == "__main__":
    main()
