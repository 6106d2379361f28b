"""pallas_call plumbing for `flash.py`'s kernels: BlockSpecs over a (tile, b, h) grid and a call that passes
absent inputs (None) through to the kernel; Triton's launch settings.

    block_specs(spec, full_q, full_rows) -> (q, kv, bias, mask, dropout source) BlockSpecs
    run(kernel, grid, in_specs, args, out_specs, out_shape, interpret, name) -> outputs
"""
from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tupe_jax.kernels import masks

NUM_WARPS, NUM_STAGES = 4, 2   # Triton's launch settings: first guesses, not tuned on a GPU yet


def block_specs(spec, full_q: bool, full_rows: bool):
    """BlockSpecs for (q, k, v, bias, mask, dropout source) over a (tile, b, h) grid, for a `flash._Spec` (sizes,
    tiles and which inputs have batch or head axes); `full_q`: q (and dO) whole per (b, h); `full_rows`: the rows of
    the bias, the mask and precomputed dropout bits whole (else the program's query tile)."""
    L, d, bq = spec.length, spec.dim, spec.bq
    q = pl.BlockSpec((None, L, None, d), lambda n, b, h: (b, 0, h, 0)) if full_q else \
        pl.BlockSpec((None, bq, None, d), lambda n, b, h: (b, n, h, 0))
    kv = pl.BlockSpec((None, L, None, d), lambda n, b, h: (b, 0, h, 0))
    rows = L if full_rows else bq
    bias = pl.BlockSpec((None, None, rows, L), lambda n, b, h: (b if spec.bias_batched else 0,
                                                              h if spec.bias_headed else 0,
                                                              0 if full_rows else n, 0))
    mask = pl.BlockSpec((None, None, rows, L), lambda n, b, h: (b if spec.mask_batched else 0, 0,
                                                              0 if full_rows else n, 0))
    return q, kv, bias, mask, masks.source_spec(spec, rows)


def run(kernel, grid, in_specs, args, out_specs, out_shape, interpret: bool, name: str):
    """pallas_call over the present inputs; absent ones (None) reach the kernel as None."""
    present = [i for i, a in enumerate(args) if a is not None]

    def wrapped(*refs):
        it = iter(refs[:len(present)])
        full = [next(it) if i in present else None for i in range(len(args))]
        kernel(*full, *refs[len(present):])

    return pl.pallas_call(
        wrapped, grid=grid, in_specs=[in_specs[i] for i in present], out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES), interpret=interpret,
        name=name,
    )(*[args[i] for i in present])
