"""On a GPU: the fused attention paths compute the same model as the explicit one; not a test (CI has no GPU).

    python benchmarks/gpu_check_fused.py [--backends cudnn,xla] [--json out.json]
    python benchmarks/gpu_check_fused.py --backends pallas --attention_dropout 0.1    # the kernel with dropout

For bert_a, tupe_a (bias and concat forms) and tupe_r, a BERT-base-width model (2 layers, d 768, 12 heads, seq 512,
batch 4, bfloat16 compute, dropout 0) is run with `attention_backend=einsum` (explicit float32 logits + softmax,
the bias gradient through `attention.add_shared_bias`) and with each fused backend. Reported: the MLM loss, the
max relative difference of the loss and the relative L2 difference of the full gradient against the einsum path,
and pass/fail at bf16 tolerance (loss 1e-2, gradient 5e-2). Exit 1 if any comparison fails or errors.
`--attention_dropout R` runs both in training mode with attention dropout R and 16-bit masks: only `pallas` keeps
its kernel then, drawing the einsum path's masks from the same key (the others run the einsum path).
`--cases alibi:bias:clm` checks a causal LM instead (every next token scored; causal ALiBi reaches cuDNN as four
extra q/k columns, `attention.cudnn_inputs`). `--smoke` runs a tiny float32 model on any backend (CPU: --backends
xla).
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

CASES = [("bert_a", "bias"), ("tupe_a", "bias"), ("tupe_a", "concat"), ("tupe_r", "bias"), ("tupe_r", "concat")]


def loss_and_grads(scheme: str, form: str, backend: str, args, objective: str = "mlm"):
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    from tupe_jax.model import ModelConfig, TransformerLM, init_params  # pylint: disable=import-outside-toplevel
    from tupe_jax.data.batch import LMBatch  # pylint: disable=import-outside-toplevel
    from tupe_jax.pretrain.steps import batch_loss  # pylint: disable=import-outside-toplevel

    width = dict(hidden_size=64, num_heads=4, mlp_dim=128, vocab_size=512) if args.smoke else \
        dict(hidden_size=768, num_heads=12, mlp_dim=3072, vocab_size=30522)
    cfg = ModelConfig(pe=scheme, num_layers=2, max_len=args.seq, dtype=args.dtype, dropout_rate=0.0,
                      attention_dropout_rate=args.attention_dropout, dropout_bits=16, tupe_form=form,
                      attention_backend=backend, objective=objective, untie_cls=objective == "mlm", **width)
    model = TransformerLM(cfg)
    params = init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    inputs = rng.integers(5, cfg.vocab_size, (args.batch, args.seq)).astype(np.int32)
    positions = np.sort(np.stack([rng.choice(np.arange(1, args.seq), 16, replace=False)
                                  for _ in range(args.batch)]), axis=1).astype(np.int32)
    if objective == "clm":   # every next token; the causal mask (causal ALiBi reaches cuDNN folded into q/k)
        batch = LMBatch(inputs=inputs, targets=np.roll(inputs, -1, 1), weights=np.ones(inputs.shape, np.float32))
        count = args.batch * args.seq
    else:
        batch = LMBatch(inputs=inputs, targets=None, weights=None, mlm_positions=positions,
                        mlm_labels=np.take_along_axis(inputs, positions, 1),
                        mlm_weights=np.ones((args.batch, 16), np.float32))
        count = args.batch * 16
    deterministic = args.attention_dropout == 0.0
    fn = jax.jit(jax.value_and_grad(lambda p: batch_loss(model, p, batch, jax.random.PRNGKey(1), deterministic)[0]
                                    / count))
    from tupe_jax.kernels.flash import TRITON_CALL  # pylint: disable=import-outside-toplevel
    if backend == "pallas" and TRITON_CALL not in fn.lower(params).as_text():
        raise RuntimeError("the pallas kernel is not in the compiled step (the einsum path would run)")
    loss, grads = fn(params)
    return float(loss), np.concatenate([np.asarray(g, np.float64).ravel() for g in jax.tree_util.tree_leaves(grads)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="cudnn,xla")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention_dropout", type=float, default=0.0)
    ap.add_argument("--cases", default="", help="subset of scheme:form[:objective], e.g. bert_a:bias,tupe_r:bias, "
                    "alibi:bias:clm (a causal LM; default objective mlm; default cases: all MLM ones)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    refuse_missing_folder(args.json)
    if args.smoke:
        args.seq, args.batch, args.dtype = 64, 2, "float32"
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    rows, ok = [], True

    def write(rows: list) -> None:
        if args.json:   # quietly: rewritten after every comparison
            write_json(args.json, {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                                   "args": vars(args), "rows": rows}, announce=False)

    cases = [tuple(c.split(":")) for c in args.cases.split(",")] if args.cases else CASES
    for scheme, form, *objective in cases:
        objective = objective[0] if objective else "mlm"
        ref_loss, ref_grad = loss_and_grads(scheme, form, "einsum", args, objective)
        for backend in args.backends.split(","):
            row = {"scheme": scheme, "form": form, "objective": objective, "backend": backend, "einsum_loss": ref_loss}
            try:
                loss, grad = loss_and_grads(scheme, form, backend, args, objective)
                row.update(loss=loss, loss_rel=abs(loss - ref_loss) / abs(ref_loss),
                           grad_rel_l2=float(np.linalg.norm(grad - ref_grad) / np.linalg.norm(ref_grad)))
                row["pass"] = row["loss_rel"] < 1e-2 and row["grad_rel_l2"] < 5e-2
            except Exception as e:  # pylint: disable=broad-except
                row.update({"pass": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                            "traceback": traceback.format_exc()[-1500:]})
            ok &= row["pass"]
            rows.append(row)
            print("#", json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
            write(rows)   # after every comparison, so a run cut off by its timeout keeps what it finished
    print(f"\ndevice: {jax.devices()[0].device_kind}, jax {jax.__version__}; 2 layers, seq {args.seq}, batch "
          f"{args.batch}, {args.dtype}; reference: attention_backend=einsum\n")
    print("| scheme | form | objective | backend | einsum loss | loss | rel. loss diff | rel. L2 grad diff | pass |")
    print("|---|---|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['scheme']} | {r['form']} | {r['objective']} | {r['backend']} | {r['einsum_loss']:.5f} | "
                  f"{r['error']} | | | no |")
        else:
            print(f"| {r['scheme']} | {r['form']} | {r['objective']} | {r['backend']} | {r['einsum_loss']:.5f} | "
                  f"{r['loss']:.5f} | "
                  f"{r['loss_rel']:.1e} | {r['grad_rel_l2']:.1e} | {'yes' if r['pass'] else 'NO'} |")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
