"""XLA compile options for the model's train and eval steps: oneDNN for XLA:CPU's dots on x86 CPUs.

jaxlib 0.10's XLA:CPU hands each dot to YNNPACK. YNNPACK runs attention's batched products, 64 products of
(128 × 64)·(64 × 128) at the reference shape (batch 16 × 4 heads, length 128, head size 64), no faster on two
cores than on one; oneDNN, and torch's `bmm`, run them 1.3–2.0× faster on two cores than on one. Measured on a
2-core AMD Zen 4 (benchmarks/RESULTS.md, "Levers of session 26"): the train step compiled with oneDNN for its dots
took 0.85–0.98× the wall time of the step with YNNPACK's, by the median of each of five in-process A/Bs. Only
that CPU kind is measured; other x86 CPUs get the same choice unmeasured.

XLA still decides per dot: it may fuse a score product Q·Kᵀ with the add that follows it (the attention mask or a
positional bias) into one YNNPACK call. The trainer's bert_a step has every dot on oneDNN; a bare loss-and-gradient
of bert_a or tupe_r keeps two of its dots on YNNPACK (tests/test_xla_options.py).

The maths is the same. Float rounding differs (another summation order inside each dot), as it does between an
AVX2 and an AVX-512 machine. XLA takes these options per executable: they apply to the executables compiled with
them and to nothing else in the process. Every executable that runs the model is compiled through `jit` below: the
trainer's step, the pretrain loop's and `evaluate`'s eval steps, the fine-tune's eval step and the analyses' forwards.

Used when the backend is XLA:CPU on an x86 machine (XLA builds its oneDNN support for x86 only). `TUPE_JAX_ONEDNN=0`
opts out and keeps XLA's default library; `1` or unset opts in. JAX's persistent compilation cache cannot store an
executable with oneDNN calls (with `JAX_COMPILATION_CACHE_DIR` set, JAX warns "ToProto is not implemented for thunk
kind: onednn-fusion" and the step compiles afresh each run): opt out where that cache matters more.

    jit(fn, **jit_kwargs)   `jax.jit` with `step_options()` (read when called): how every model executable is jitted
    step_options(backend=None, machine=None, environ=None) -> dict | None   the compiler_options for a step
    dot_library(backend=None, machine=None, environ=None) -> 'onednn' | 'xla'   which library the steps' dots use
    opted_out(environ=None) -> bool     TUPE_JAX_ONEDNN read and checked (the launcher checks it before any work)
"""
from __future__ import annotations

import os
import platform
from typing import Mapping, Optional

from tupe_jax.errors import UserError

OPT_OUT = "TUPE_JAX_ONEDNN"
X86 = ("x86_64", "amd64", "x86-64")
# every dot of the executable to oneDNN, one library call per dot (no fused elementwise neighbours)
ONEDNN_DOTS = {"xla_cpu_use_onednn": True,
               "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


def opted_out(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when `TUPE_JAX_ONEDNN=0`; a value other than 0, 1 or unset is a UserError."""
    setting = (os.environ if environ is None else environ).get(OPT_OUT, "")
    if setting not in ("", "0", "1"):
        raise UserError(f"{OPT_OUT}={setting!r} is neither 0 nor 1", "the environment",
                        f"set {OPT_OUT}=0 (XLA's default dot library), 1 (oneDNN on x86 CPUs) or unset it")
    return setting == "0"


def dot_library(backend: Optional[str] = None, machine: Optional[str] = None,
                environ: Optional[Mapping[str, str]] = None) -> str:
    """'onednn' where the steps' dots go to oneDNN (module docstring), else 'xla' (XLA's default library).
    `backend` defaults to `jax.default_backend()`, `machine` to `platform.machine()`."""
    if opted_out(environ):
        return "xla"
    if backend is None:
        import jax  # pylint: disable=import-outside-toplevel
        backend = jax.default_backend()
    machine = platform.machine() if machine is None else machine
    return "onednn" if backend == "cpu" and machine.lower() in X86 else "xla"


def step_options(backend: Optional[str] = None, machine: Optional[str] = None,
                 environ: Optional[Mapping[str, str]] = None) -> Optional[dict]:
    """The `compiler_options` for a train or eval step: `ONEDNN_DOTS` where `dot_library` says oneDNN, else None."""
    return dict(ONEDNN_DOTS) if dot_library(backend, machine, environ) == "onednn" else None


def jit(fn, **jit_kwargs):
    """`jax.jit(fn, **jit_kwargs)` compiled with `step_options()`, read now (a decorator too)."""
    import jax  # pylint: disable=import-outside-toplevel
    return jax.jit(fn, compiler_options=step_options(), **jit_kwargs)
