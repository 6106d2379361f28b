"""In-process A/B of the MLM head's loss and gradient: the plain form against `head.tied_cross_entropy`'s chunks.

    python benchmarks/bench_head.py --rows 320,640,1024,2048 --chunks 0,128,256,512 --rounds 11 \
        --json benchmarks/results_head_chunks.json

The head alone at the benchmark's width (D 256, V 8192, float32, the MLM bias), value and gradient with respect
to h, E and b, for each row count M in `--rows` (the benchmark's equal work is 16 × 128 = 2048 rows, its default
head 16 × 20 = 320). Variants: `plain` (the full (M, V) logits, `head._plain`) and `chunks=<r>`, the chunked
gradient form forced at about r rows a chunk (`head.chunking`; 0: one chunk of all M rows). Each round runs every
variant in turn, `--steps` synced calls each; a variant's ratio to `plain` is taken within each round; reported:
the median over rounds with its min–max and, from 6 rounds, the median's 95% interval (`rounds.spread`). Also
checked before timing: every variant's loss and gradients match `plain` within 1e-5 relative. `--dots onednn`
compiles every variant with oneDNN for its dots, as the train step is on an x86 CPU (`tupe_jax/xla_options.py`);
the default, `xla`, is XLA:CPU's own library, as the runs before session 26 were. `--torch` adds `torch`, the
same loss and gradients as HF `BertForMaskedLM`'s head computes them (`F.linear` against the tied table with its
bias, then `F.cross_entropy`, weighted here, and `backward`; torch's default threads), checked against `plain` like
the others, and reports torch's time over each of ours within each round (`torch_over`). `--before` adds, for
each chunk size, `chunks=<r> (before)`: the chunked form as it was before session 49, whose ∂Eᵀ product was a
transposed-operand dot inside the loop. Not a test.
"""
from __future__ import annotations

import argparse
import importlib.util
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

D, V = 256, 8192
TORCH = "torch"


def variants(m: int, chunks: list[int], compiler_options=None, torch: bool = False, before: bool = False) -> dict:
    """{name: (h, E, b) -> (loss, grads)} for m rows (module docstring): ours jitted with `compiler_options`,
    with `torch` the torch head, with `before` each chunk size's form before session 49 too (`before_chunked_fwd`,
    compiled here)."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from tupe_jax import head  # pylint: disable=import-outside-toplevel

    k = jax.random.split(jax.random.PRNGKey(m), 2)
    labels = jax.random.randint(k[0], (m,), 0, V)
    weights = (jax.random.uniform(k[1], (m,)) > 0.15).astype(jnp.float32)

    def grad(fn):
        return jax.jit(jax.value_and_grad(lambda h, e, b: fn(h, e, b)[0], argnums=(0, 1, 2)),
                       compiler_options=compiler_options)

    out = {"plain": grad(lambda h, e, b: head._plain(h, e, b, labels, weights))}  # pylint: disable=protected-access
    for rows in chunks:
        out[f"chunks={rows}"] = grad(lambda h, e, b, r=rows or m: head.tied_cross_entropy(
            h, e, b, labels, weights, jnp.float32, rows=r))
    if before:
        specs = (jax.ShapeDtypeStruct((m, D), jnp.float32), jax.ShapeDtypeStruct((V, D), jnp.float32),
                 jax.ShapeDtypeStruct((V,), jnp.float32))
        head._chunked.defvjp(before_chunked_fwd, head._chunked_bwd)  # pylint: disable=protected-access
        try:
            for rows in chunks:
                out[f"chunks={rows} (before)"] = out[f"chunks={rows}"].lower(*specs).compile()
                out[f"chunks={rows}"] = grad(lambda h, e, b, r=rows or m: head.tied_cross_entropy(
                    h, e, b, labels, weights, jnp.float32, rows=r))       # traced afresh below, as it is now
        finally:
            head._chunked.defvjp(head._chunked_fwd, head._chunked_bwd)  # pylint: disable=protected-access
    if torch:
        out[TORCH] = torch_head(labels, weights)
    return out


def before_chunked_fwd(n, size, has_bias, h, embedding, bias, labels, weights):
    """`head._chunked_fwd` before session 49 (the same values): the chunk's ∂Eᵀ product as a transposed-operand dot
    hcᵀ · ∂z inside the loop, instead of against hᵀ's chunk transposed once before it."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from tupe_jax.head import argmax_hits  # pylint: disable=import-outside-toplevel
    m, d = h.shape
    v = embedding.shape[0]
    pad = n * size - m
    if pad:
        h = jnp.pad(h, ((0, pad), (0, 0)))
        labels, weights = jnp.pad(labels, (0, pad)), jnp.pad(weights, (0, pad))
    strided = lambda x: jnp.swapaxes(x.reshape(size, n, *x.shape[1:]), 0, 1)  # noqa: E731
    e_t = jax.lax.optimization_barrier(embedding.T)
    index = jnp.arange(v, dtype=jnp.int32)

    def chunk(carry, xs):
        d_et, d_b = carry
        hc, lc, wc = xs
        z = (hc @ e_t).astype(jnp.float32) + (bias if has_bias else 0.0)
        top = jnp.max(z, axis=-1, keepdims=True)
        e = jnp.exp(z - top)
        total = jnp.sum(e, axis=-1)
        at_label = jnp.take_along_axis(z, lc[:, None], axis=-1)[:, 0]
        nll = jnp.sum((top[:, 0] + jnp.log(total) - at_label) * wc)
        hits = jnp.sum(argmax_hits(z, lc) * wc)
        dz = e * (wc / total)[:, None] - jnp.where(index == lc[:, None], wc[:, None], 0.0)
        dh = dz.astype(embedding.dtype) @ embedding
        d_et = d_et + jnp.matmul(hc.T, dz.astype(hc.dtype), preferred_element_type=jnp.float32)
        if has_bias:
            d_b = d_b + jnp.sum(dz, axis=0)
        return (d_et, d_b), (nll, hits, dh)

    init = (jnp.zeros((d, v), jnp.float32), jnp.zeros((v,), jnp.float32))
    (d_et, d_b), (nll, hits, dh) = jax.lax.scan(chunk, init, (strided(h), strided(labels), strided(weights)))
    dh = jnp.swapaxes(dh, 0, 1).reshape(n * size, d)[:m]
    return (jnp.sum(nll), jnp.sum(hits)), (dh, d_et, d_b)


def torch_head(labels, weights):
    """(h, E, b) -> (Σ w·NLL, (∂h, ∂E, ∂b)) in torch as HF's head computes it (module docstring). The inputs are
    copied to torch tensors when they are not the arrays of the call before (so the timed calls, all on the same
    arrays, copy nothing); each call returns torch tensors."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import torch  # pylint: disable=import-outside-toplevel
    import torch.nn.functional as F  # pylint: disable=import-outside-toplevel
    labels_t = torch.from_numpy(np.array(labels)).long()     # a copy: torch wants it writable
    weights_t = torch.from_numpy(np.array(weights))
    held = {}

    def run(h, e, b):
        if held.get("inputs") is None or any(x is not y for x, y in zip(held["inputs"], (h, e, b))):
            held["inputs"] = (h, e, b)
            held["leaves"] = [torch.from_numpy(np.array(x)).requires_grad_() for x in (h, e, b)]
        th, te, tb = held["leaves"]
        for leaf in held["leaves"]:
            leaf.grad = None
        loss = (F.cross_entropy(F.linear(th, te, tb), labels_t, reduction="none") * weights_t).sum()
        loss.backward()
        return loss.detach(), (th.grad, te.grad, tb.grad)
    return run


def leaves(result) -> list:
    """A variant's (loss, grads) as numpy arrays, for the check against `plain` (torch's tensors too)."""
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    return [x.numpy() if hasattr(x, "requires_grad") else np.asarray(x) for x in jax.tree_util.tree_leaves(result)]


def torch_over(times: dict) -> dict:
    """{ours: spread of torch's ms ÷ ours, taken within each round} for each of our variants in `times`."""
    out = {}
    for name, values in times.items():
        if name != TORCH:
            out[name] = spread([t / o for t, o in zip(times[TORCH], values)])
            ci = out[name]["ci95"] or [out[name]["min"], out[name]["max"]]
            print(f"    torch ÷ {name}: {out[name]['median']:.3f} ({ci[0]:.3f}–{ci[1]:.3f})", flush=True)
    return out


def counts(text: str) -> list[int]:
    """'320,640' -> [320, 640]; anything but comma-separated whole numbers ≥ 0 is refused by argparse."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = [-1]
    if min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers")
    return values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=counts, default="320,640,1024,2048", help="comma-separated head rows")
    ap.add_argument("--chunks", type=counts, default="0,128,256,512", help="comma-separated chunk sizes (0: none)")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dots", choices=("xla", "onednn"), default="xla",
                    help="the dot library: XLA:CPU's default (as before session 26) or oneDNN (xla_options.ONEDNN_DOTS,"
                    " as the train step compiles on an x86 CPU)")
    ap.add_argument("--torch", action="store_true", help="add HF's head in torch (module docstring)")
    ap.add_argument("--before", action="store_true", help="add each chunk size's form before session 49")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    refuse_below(args, rounds=1, steps=1)
    if args.torch and importlib.util.find_spec("torch") is None:
        sys.exit("error: --torch needs torch, which is not installed, the environment, "
                 "pip install -e '.[bench]' or leave out --torch")
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    from tupe_jax.host import cpu_description  # pylint: disable=import-outside-toplevel
    from tupe_jax.xla_options import ONEDNN_DOTS  # pylint: disable=import-outside-toplevel
    load_before = os.getloadavg()
    out = {"command": "python benchmarks/bench_head.py " + shlex.join(sys.argv[1:]), "cpu": cpu_description(),
           "jax": jax.__version__, "dots": args.dots, "loadavg_before": load_before, "shapes": {}}
    for m in args.rows:
        chunks = [x for x in args.chunks if x < m]
        fns = variants(m, chunks, ONEDNN_DOTS if args.dots == "onednn" else None, args.torch, args.before)
        k = jax.random.split(jax.random.PRNGKey(0), 3)
        inputs = (jax.random.normal(k[0], (m, D)), jax.random.normal(k[1], (V, D)) * 0.05,
                  jax.random.normal(k[2], (V,)) * 0.1)
        want = leaves(fns["plain"](*inputs))
        for name, fn in fns.items():
            for got, ref in zip(leaves(fn(*inputs)), want):
                np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5,
                                           atol=1e-5 * float(np.max(np.abs(ref))), err_msg=f"{name} at {m} rows")
        times = {name: [] for name in fns}
        for i in range(args.rounds):
            for name, fn in rotated(fns.items(), i):
                jax.block_until_ready(fn(*inputs))    # torch's tensors pass through: its work is done on return
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    result = fn(*inputs)
                jax.block_until_ready(result)
                times[name].append(1e3 * (time.perf_counter() - t0) / args.steps)
            print(f"{m} rows: round {i + 1}/{args.rounds}", flush=True)
        entry = {"ms_per_round": times, "ratio_to_plain": {}}
        for name, values in times.items():
            r = spread([a / b for a, b in zip(values, times["plain"])])
            entry["ratio_to_plain"][name] = r
            ci = f", 95% interval {r['ci95'][0]:.3f}–{r['ci95'][1]:.3f}" if r["ci95"] else ""
            print(f"  {m} rows, {name}: {statistics.median(values):.1f} ms; {r['median']:.3f}× plain "
                  f"({r['min']:.3f}–{r['max']:.3f}{ci})", flush=True)
        if TORCH in times:
            entry["torch_over"] = torch_over(times)
        out["shapes"][str(m)] = entry
    out["loadavg_after"] = os.getloadavg()
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
