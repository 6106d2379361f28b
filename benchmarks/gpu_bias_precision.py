"""On a GPU: how exactly each fused attention path keeps the positional bias in bf16; not a test (CI has no GPU).
Run on an H200 in session 22 (results_gpu_h200_bias_precision.json, before `cudnn_inputs`); `--backends xla` runs
it on CPU.

    python benchmarks/gpu_bias_precision.py [--backends xla,cudnn] [--json out.json]
    python benchmarks/gpu_bias_precision.py --backends xla,cudnn_model   # on CPU: cuDNN's inputs, xla's kernel

The inputs and reference (tests/attention_fixtures.py) of
`tests/test_fused_bias.py::test_xla_fused_path_keeps_a_long_alibi_bias_in_float32` and
`::test_fused_paths_keep_a_tupe_r_bias_exact_enough`, at head dim 64 (cuDNN's kernels want a multiple of 8):
causal ALiBi at 1024 tokens (8 heads; random q/k, and q/k whose content logit +m_h·(i − j) spreads the softmax
mass over far keys, where the bias is largest) and TUPE-R's real bias at 512 tokens magnified to about ±32 (random
q/k, and q = 0). bf16 q/k/v; each backend through `attention.fused_attention` (xla: float32 bias; cudnn:
`attention.cudnn_inputs`, causal ALiBi as four exact q/k columns, TUPE-R's bias shifted and in bf16) against the
float32 einsum path on the same values. Reported
per case: max |difference|, the bound 2u·max|v| + 1e-4 (u = 2⁻⁸: the kernel's own bf16 roundings of the
probabilities and the output; the tests' tolerance) and the pre-fix path (bias cast to bf16, xla kernel).
Exit 1 if a backend exceeds the bound or errors.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from outputs import refuse_missing_folder, write_json  # noqa: E402  pylint: disable=wrong-import-position


def cases():
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    from tests.attention_fixtures import alibi_cases, tupe_r_terms  # pylint: disable=import-outside-toplevel

    out = {}
    alibi, terms, mask = alibi_cases(1024, 8, 64)
    for name, inputs in alibi.items():
        out[f"alibi-1024 {name}"] = (inputs, terms, mask)
    length, heads, hidden = 512, 8, 512
    terms = tupe_r_terms(length, heads, hidden, kernel_growth=6.0)
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(2, length, heads, hidden // heads)), jnp.bfloat16) for _ in range(3))
    out["tupe_r-512 random"] = ((q, k, v), terms, None)
    out["tupe_r-512 q=0"] = ((jnp.zeros_like(q), k, v), terms, None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="xla,cudnn")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from tests.attention_fixtures import (bf16_bound, bias_cast_to_bf16, cudnn_like,  # pylint: disable=import-outside-toplevel
                                          einsum_reference, max_err as err)
    from tupe_jax.attention import fused_attention  # pylint: disable=import-outside-toplevel

    rows, failed = [], False
    for name, ((q, k, v), terms, mask) in cases().items():
        ref, bound = einsum_reference(q, k, v, terms, mask), bf16_bound(v)
        pre_fix = bias_cast_to_bf16(q, k, v, terms, mask)
        row = {"case": name, "bound": bound, "bias_abs_max": float(jnp.abs(terms.logit_bias).max()),
               "pre_fix_bf16_bias_xla": err(pre_fix, ref)}
        for backend in args.backends.split(","):
            try:
                out = (cudnn_like(terms, mask) if backend == "cudnn_model" else
                       jax.jit(lambda a, b, c, be=backend: fused_attention(a, b, c, terms, mask, be)))(q, k, v)
                row[backend] = err(out, ref)
                failed |= row[backend] > bound
            except Exception as e:  # pylint: disable=broad-except
                row[backend] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                traceback.print_exc()
                failed = True
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "rows": rows}
    if args.json:
        write_json(args.json, result)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
