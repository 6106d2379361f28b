"""Peak host memory of a long-context evaluation forward: the tiny causal model at 8192 tokens; not a test.

    python benchmarks/memory_long_eval.py [--length 8192] [--schemes rope,alibi,nopos] [--backend einsum]

Each scheme runs in its own subprocess (so peak RSS is that scheme's alone): build
`configs/pretrain.py:pe=<scheme>,size=tiny,objective=clm`, init params, one jitted deterministic forward over one
sequence of `--length` tokens (the CLM eval loss), and report `resource.getrusage(RUSAGE_SELF).ru_maxrss` (peak
RSS of the process, incl. the Python/JAX runtime and compilation) next to the budget (4 GiB). The attention
logits are materialised per layer ((1, H, L, L) float32 = 512 MiB at H=2, L=8192), so this is the number that
tells whether long-context evaluation of these schemes fits a small machine. `--json` gets
{length, backend, rows: one per scheme, environment} (the committed file from before that is the bare list of rows).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from outputs import refuse_below, refuse_failed, refuse_missing_folder, refuse_unknown, write_json  # noqa: E402  pylint: disable=wrong-import-position
BUDGET_GIB = 4.0


def worker(scheme: str, length: int, backend: str) -> dict:
    sys.path.insert(0, ROOT)
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import optax  # pylint: disable=import-outside-toplevel
    from configs.pretrain import get_config  # pylint: disable=import-outside-toplevel
    from tupe_jax.model import ModelConfig, TransformerLM, init_params  # pylint: disable=import-outside-toplevel

    config = get_config(f"pe={scheme},size=tiny,objective=clm")
    with config.unlocked():
        config.model.attention_backend = backend
    cfg = ModelConfig.from_config(config.model)
    params = init_params(cfg, jax.random.PRNGKey(0))
    model = TransformerLM(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, length + 1), 5, cfg.vocab_size)

    @jax.jit
    def eval_loss(p, toks):
        logits = model.apply({"params": p}, toks[:, :-1], deterministic=True)["logits"]
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:]))

    t0 = time.perf_counter()
    loss = float(eval_loss(params, tokens))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    loss = float(eval_loss(params, tokens))
    second = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"scheme": scheme, "length": length, "backend": backend, "loss": loss, "peak_rss_bytes": peak,
            "first_call_s": first, "forward_s": second,
            "model": f"{cfg.num_layers}L d{cfg.hidden_size} H{cfg.num_heads} mlp{cfg.mlp_dim} V{cfg.vocab_size}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--schemes", default="rope,alibi,nopos")
    ap.add_argument("--backend", default="einsum", help="model.attention_backend: einsum | xla")
    ap.add_argument("--json", default="")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    refuse_below(args, length=1)
    if args.worker:
        print(json.dumps(worker(args.worker, args.length, args.backend)))
        return
    sys.path.insert(0, ROOT)
    from tupe_jax.positional import ALIASES, SCHEMES  # pylint: disable=import-outside-toplevel
    refuse_unknown("--schemes", args.schemes.split(","), SCHEMES + tuple(ALIASES), "schemes")
    rows = []
    for scheme in args.schemes.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", scheme, "--length", str(args.length),
               "--backend", args.backend]
        env = dict(os.environ)
        env.setdefault("JAX_PLATFORMS", "cpu")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            rows.append({"scheme": scheme, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]})
        else:
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"tiny causal model, one sequence of {args.length} tokens, jitted eval forward, backend={args.backend}; "
          f"peak RSS = ru_maxrss of a fresh process per scheme (budget {BUDGET_GIB:g} GiB)\n")
    print("| scheme | model | peak RSS (GiB) | under 4 GiB | forward s (2nd call) | loss |")
    print("|---|---|---:|---|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['scheme']} | error: {r['error']} | | | | |")
            continue
        gib = r["peak_rss_bytes"] / 2 ** 30
        print(f"| {r['scheme']} | {r['model']} | {gib:.2f} | {'yes' if gib < BUDGET_GIB else 'NO'} | "
              f"{r['forward_s']:.2f} | {r['loss']:.3f} |")
    refuse_failed({r["scheme"]: r["error"] for r in rows if "error" in r}, args.json)
    if args.json:
        write_json(args.json, {"length": args.length, "backend": args.backend, "rows": rows})


if __name__ == "__main__":
    main()
