"""XLA compile options for the model's train and eval steps: oneDNN for XLA:CPU's dots on x86 CPUs with AVX-512.

jaxlib 0.10's XLA:CPU hands each dot to YNNPACK. YNNPACK runs attention's batched products, 64 products of
(128 × 64)·(64 × 128) at the reference shape (batch 16 × 4 heads, length 128, head size 64), no faster on two
cores than on one; oneDNN, and torch's `bmm`, run them 1.3–2.0× faster on two cores than on one. Measured on
2-core VMs (benchmarks/RESULTS.md), the train step with oneDNN for its dots against XLA's default library:
- AMD Zen 4 with AVX-512: 0.85–0.98× the wall time by the median of each of five in-process A/Bs ("Levers of
  session 26"); Intel Xeon with AVX-512 (family 6 model 207): XLA's library took 1.10× the time (session 31);
- AMD Zen 3 with AVX2 only (family 25 model 1): the other way round, XLA's library took 0.92× the time at equal
  work (interval of the median 0.81–0.96, session 49). There oneDNN's AVX2 kernels ran two of the MLM head's three
  products per chunk ((256 × 256)·(256 × 8192) and the like) at about half YNNPACK's rate.
So by default the steps' dots go to oneDNN where the CPU reports AVX-512 (`avx512f` in /proc/cpuinfo's flags, or
where those flags cannot be read, as before this rule), and stay on XLA's library on x86 CPUs without it. Other
x86 CPUs get that choice unmeasured.

XLA still decides per dot: it may fuse a score product Q·Kᵀ with the add that follows it (the attention mask or a
positional bias) into one YNNPACK call. The trainer's bert_a step has every dot on oneDNN; a bare loss-and-gradient
of bert_a or tupe_r keeps two of its dots on YNNPACK (tests/test_xla_options.py).

The maths is the same. Float rounding differs (another summation order inside each dot), as it does between an
AVX2 and an AVX-512 machine. XLA takes these options per executable: they apply to the executables compiled with
them and to nothing else in the process. Every executable that runs the model is compiled through `jit` below: the
trainer's step, the pretrain loop's and `evaluate`'s eval steps, the fine-tune's eval step and the analyses' forwards.

Used when the backend is XLA:CPU on an x86 machine (XLA builds its oneDNN support for x86 only). `TUPE_JAX_ONEDNN=0`
keeps XLA's default library everywhere, `1` takes oneDNN on every x86 CPU, unset is the rule above. JAX's persistent
compilation cache cannot store an executable with oneDNN calls (with `JAX_COMPILATION_CACHE_DIR` set, JAX warns
"ToProto is not implemented for thunk kind: onednn-fusion" and the step compiles afresh each run): opt out where
that cache matters more. `provenance.jsonl` records which library a run's steps used (`dot_library`).

    jit(fn, **jit_kwargs)   `jax.jit` with `step_options()` (read when called): how every model executable is jitted
    step_options(backend=None, machine=None, environ=None, avx512=None) -> dict | None   a step's compiler_options
    dot_library(backend=None, machine=None, environ=None, avx512=None) -> 'onednn' | 'xla'   the steps' dot library
    setting(environ=None) -> '' | '0' | '1'   TUPE_JAX_ONEDNN read and checked (the launcher checks it first)
    cpu_has_avx512(cpuinfo=host.CPUINFO) -> bool | None   `avx512f` among the CPU's flags; None where none are read
"""
from __future__ import annotations

import os
import platform
from typing import Mapping, Optional

from tupe_jax import host
from tupe_jax.errors import UserError

OPT_OUT = "TUPE_JAX_ONEDNN"
X86 = ("x86_64", "amd64", "x86-64")
# every dot of the executable to oneDNN, one library call per dot (no fused elementwise neighbours)
ONEDNN_DOTS = {"xla_cpu_use_onednn": True,
               "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


def setting(environ: Optional[Mapping[str, str]] = None) -> str:
    """TUPE_JAX_ONEDNN: '' (unset: the default rule), '0' or '1'; any other value is a UserError."""
    value = (os.environ if environ is None else environ).get(OPT_OUT, "")
    if value not in ("", "0", "1"):
        raise UserError(f"{OPT_OUT}={value!r} is neither 0 nor 1", "the environment",
                        f"set {OPT_OUT}=0 (XLA's default dot library), 1 (oneDNN on every x86 CPU) or unset it "
                        "(oneDNN where the CPU has AVX-512)")
    return value


def cpu_has_avx512(cpuinfo: str = host.CPUINFO) -> Optional[bool]:
    """Whether the CPU's flags (`host.cpu_info` of the file `cpuinfo`) hold `avx512f`; None where none are read."""
    isa = host.cpu_info(cpuinfo)["isa"]
    return None if not isa else isa == "avx512f"


def dot_library(backend: Optional[str] = None, machine: Optional[str] = None,
                environ: Optional[Mapping[str, str]] = None, avx512: Optional[bool] = None) -> str:
    """'onednn' where the steps' dots go to oneDNN (module docstring), else 'xla' (XLA's default library).
    `backend` defaults to `jax.default_backend()`, `machine` to `platform.machine()`, `avx512` to
    `cpu_has_avx512()` (read only when the choice depends on it)."""
    value = setting(environ)
    if value == "0":
        return "xla"
    if backend is None:
        import jax  # pylint: disable=import-outside-toplevel
        backend = jax.default_backend()
    machine = platform.machine() if machine is None else machine
    if backend != "cpu" or machine.lower() not in X86:
        return "xla"
    if value == "1":
        return "onednn"
    avx512 = cpu_has_avx512() if avx512 is None else avx512
    return "xla" if avx512 is False else "onednn"


def step_options(backend: Optional[str] = None, machine: Optional[str] = None,
                 environ: Optional[Mapping[str, str]] = None, avx512: Optional[bool] = None) -> Optional[dict]:
    """The `compiler_options` for a train or eval step: `ONEDNN_DOTS` where `dot_library` says oneDNN, else None."""
    return dict(ONEDNN_DOTS) if dot_library(backend, machine, environ, avx512) == "onednn" else None


def jit(fn, **jit_kwargs):
    """`jax.jit(fn, **jit_kwargs)` compiled with `step_options()`, read now (a decorator too)."""
    import jax  # pylint: disable=import-outside-toplevel
    return jax.jit(fn, compiler_options=step_options(), **jit_kwargs)
