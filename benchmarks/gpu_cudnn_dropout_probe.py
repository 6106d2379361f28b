"""On a GPU: can cuDNN's fused attention carry the paper's attention dropout in training? Not a test (CI has no
GPU). Prepared, NOT yet run on a GPU (no device in the session that wrote it); on CPU it stops with an error line.

    python benchmarks/gpu_cudnn_dropout_probe.py [--json out.json]

JAX exposes cuDNN's dropout only through a private entry point, `jax._src.cudnn.fused_attention_stablehlo.
dot_product_attention(..., dropout_rate, seed: int)`, whose seed is a Python int written into the kernel's
backend config when the step is compiled (not a traced key). Whether that can serve a training loop decides
issue #18's item 4, so the probe answers, on one small input (bf16, B 8, L 64, 8 heads, d 64; q = k = 0, so every
probability is 1/L, and v = L·I over the keys, so output[t, s] = keep[t, s]/(1 − rate): the mask itself):
  1. the realised drop rate: the fraction of zero outputs, against `rate`;
  2. fresh masks per call: two calls of one compiled function on the same inputs. Equal outputs mean every step
     would reuse one mask, so the route is unusable without a recompile per step;
  3. determinism: the same two calls in a second compile of the same function (equal = reproducible, which
     exact resume needs);
  4. a traced seed: whether `seed` accepts a jax value at all (a per-step key would need that).
Writes the answers to `--json` (default benchmarks/results_gpu_cudnn_dropout_probe.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from outputs import refuse_missing_folder, write_json  # noqa: E402  pylint: disable=wrong-import-position


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=0.1)
    ap.add_argument("--json", default=os.path.join(HERE, "results_gpu_cudnn_dropout_probe.json"))
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    if jax.default_backend() != "gpu":
        sys.exit(f"error: needs a CUDA GPU (jax.default_backend() is {jax.default_backend()}), "
                 "benchmarks/gpu_cudnn_dropout_probe.py, run it on the device machine")
    from jax._src.cudnn.fused_attention_stablehlo import (  # pylint: disable=import-outside-toplevel
        dot_product_attention)

    batch, length, heads, dim = 8, 64, 8, 64
    q = k = jnp.zeros((batch, length, heads, dim), jnp.bfloat16)
    eye = (jnp.eye(length) * length)[None, :, None, :]
    v = jnp.broadcast_to(eye, (batch, length, heads, dim)).astype(jnp.bfloat16)

    def attend(q, k, v, seed=42):
        return dot_product_attention(q, k, v, scale=1.0, dropout_rate=args.rate, seed=seed)

    out = {"jax": jax.__version__, "device": str(jax.devices()[0]), "rate": args.rate,
           "shape_bthd": [batch, length, heads, dim]}
    try:
        first = jax.jit(attend)
        a, b = first(q, k, v), first(q, k, v)
        c = jax.jit(lambda q, k, v: attend(q, k, v))(q, k, v)     # a second compile of the same computation
    except Exception as err:  # pylint: disable=broad-except
        out["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        print(json.dumps(out, indent=1))
        write_json(args.json, out)
        sys.exit(1)
    out["realised_drop_rate"] = float(jnp.mean(jnp.asarray(a, jnp.float32) == 0.0))
    out["kept_value"] = float(jnp.max(jnp.asarray(a, jnp.float32)))      # expect 1/(1 - rate), in bf16
    out["fresh_mask_per_call"] = bool(jnp.any(a != b))
    out["same_masks_after_recompile"] = bool(jnp.all(a == c))
    try:
        jax.jit(lambda q, k, v, s: attend(q, k, v, seed=s))(q, k, v, jnp.int32(7))
        out["traced_seed"] = "accepted"
    except Exception as err:  # pylint: disable=broad-except
        out["traced_seed"] = f"refused: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    print(json.dumps(out, indent=1))
    write_json(args.json, out)


if __name__ == "__main__":
    main()
