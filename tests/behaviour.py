"""The behaviour fingerprint: 20-step float32 losses and final parameter checksums of every scheme in both
families (MLM encoder, causal decoder) and of one GLUE fine-tune, through the real loops.

`tests/data/behaviour.json` was recorded BEFORE the redesign of the trainer/run-folder layers (`python
tests/behaviour.py --write`); `tests/test_behaviour.py` re-runs the same loops and requires bitwise-equal losses
and parameters when the stack is one a recording was made on (a different stack may legitimately change float
rounding: then the test compares to 1e-5 relative to the primary recording).

The stack is the versions that decide float rounding, the host CPU's kind (`tupe_jax.host.cpu_kind`) and how XLA
compiled: XLA:CPU compiles for the host's vector ISA, so the same code and versions round differently on an AVX2 and
an AVX-512 machine, and the suite's fast compile (-O0, tests/xla_flags.py) emits other machine code than XLA's
default; so does the library the steps' dots run on (`tupe_jax.xla_options`: oneDNN on x86 with AVX-512 unless
TUPE_JAX_ONEDNN=0, which the suite sets). The primary recording is `behaviour.json` (XLA's default compile); a
recording of the same numbers on another CPU kind, at the fast compile or with oneDNN dots sits beside it as
`behaviour-<cpu kind>[-fast-compile][-onednn].json` (`--add`, `--add-fast`), and every such file must agree with
the primary to 1e-5. The CPU kind holds the family and model numbers since session 49 (`host.py` says why): the
recordings made before (their `cpu` has none) match no machine's stack now, and count as other CPUs' numbers.

    python tests/behaviour.py --write     the numbers changed: record this machine, drop every other recording
    python tests/behaviour.py --add       the numbers did not change: add (or renew) this CPU kind's recording
    python tests/behaviour.py --add-fast  the same at the suite's fast compile (the every-scheme test runs there)
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# the suite's 8 fake devices (tests/conftest.py): the recording must come from the device count the test runs on,
# since the sharded weight-gradient sums (projection.dense_dot_general) round differently on one device; and XLA's
# default optimisation level unless a recording is made at the suite's fast compile (`COMPILES`, `record_at`)
RECORDING_XLA_FLAGS = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("XLA_FLAGS", RECORDING_XLA_FLAGS)
from tupe_jax import host, positional, xla_options  # noqa: E402  pylint: disable=wrong-import-position
from tests import xla_flags  # noqa: E402  pylint: disable=wrong-import-position

# how a recording may be compiled: XLA's default (the primary, and the bitwise link to the code before the redesign)
# or the suite's fast compile (tests/xla_flags.py), which the every-scheme test uses: most of its time is compiling
COMPILES = {"default": RECORDING_XLA_FLAGS, "fast": f"{RECORDING_XLA_FLAGS} {xla_flags.FAST_COMPILE}"}

GOLDEN = os.path.join(ROOT, "tests", "data", "behaviour.json")
SCHEMES = positional.SCHEMES        # a scheme added there is missing from the recordings until --write
OBJECTIVES = ("mlm", "clm")
STEPS = 20
# dropout_bits 32: the golden was recorded with flax's 32-bit dropout masks, before 16-bit masks became the default;
# last_layer_rows all: with every row of the MLM encoder's last block, before the predicted rows became the default
# (the same maths, other float rounding of the gradients: tests/test_last_layer_rows.py)
MODEL = {"model.hidden_size": "32", "model.num_layers": "2", "model.num_heads": "2", "model.mlp_dim": "64",
         "model.vocab_size": "512", "model.max_len": "32", "model.dtype": "float32", "model.dropout_bits": "32",
         "model.last_layer_rows": "all"}
PRETRAIN = {**MODEL, "train.steps": str(STEPS), "train.batch_size": "8", "train.learning_rate": "3e-3",
            "train.warmup_steps": "5", "train.log_every": "1", "train.eval_every": "0", "train.eval_steps": "1",
            "checkpoint.every": "1000", "checkpoint.async_save": "false"}
FINETUNE = {**MODEL, "train.steps": str(STEPS), "train.batch_size": "8", "train.eval_batch_size": "16",
            "train.learning_rate": "1e-3", "train.log_every": "1", "train.predict_test": "false",
            "checkpoint.every": "1000", "checkpoint.async_save": "false", "data.glue_buckets": "(32,)"}


def compile_kind() -> str:
    """Which of `COMPILES` this process's XLA_FLAGS are (a recording is made at one of them only)."""
    flags = os.environ.get("XLA_FLAGS", "")
    for kind, want in COMPILES.items():
        if flags == want:
            return kind
    sys.exit(f"error: XLA_FLAGS is {flags!r}, not a recording's {COMPILES['default']!r} or {COMPILES['fast']!r}, "
             "unset XLA_FLAGS (or use record_at)")


def stack() -> dict[str, str]:
    """The versions, the CPU kind, the compile and the steps' dot library that decide float rounding."""
    import jax  # pylint: disable=import-outside-toplevel
    import jaxlib  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "numpy": np.__version__,
            "device": jax.devices()[0].device_kind, "cpu": host.cpu_kind(), "compile": compile_kind(),
            "dots": xla_options.dot_library()}


def recording_path(of: dict) -> str:
    """Where the recording of the stack `of` lives when it is not the primary."""
    name = re.sub(r"[^a-z0-9]+", "-", of["cpu"].lower()) + ("-fast-compile" if of["compile"] == "fast" else "") \
        + ("-onednn" if of.get("dots", "xla") == "onednn" else "")
    return os.path.join(os.path.dirname(GOLDEN), f"behaviour-{name}.json")


def recordings() -> list[dict]:
    """Every recording, the primary (`behaviour.json`) first; a stack recorded before compiles were told apart
    was compiled at XLA's default, and one recorded before the steps could use oneDNN used XLA's dot library."""
    paths = [GOLDEN] + sorted(glob.glob(os.path.join(os.path.dirname(GOLDEN), "behaviour-*.json")))
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            out.append(json.load(f))
        out[-1]["stack"].setdefault("compile", "default")
        out[-1]["stack"].setdefault("dots", "xla")
    return out


def agrees(result: dict, want: dict, rel: float = 1e-5) -> bool:
    """The same numbers up to float rounding: every loss and the parameters' |sum| within `rel`."""
    close = lambda a, b: abs(a - b) <= rel * max(abs(a), abs(b))  # noqa: E731
    return (len(result["losses"]) == len(want["losses"])
            and all(close(a, b) for a, b in zip(result["losses"], want["losses"]))
            and close(result["params"]["abs_sum"], want["params"]["abs_sum"]))


def checksum(params) -> dict[str, object]:
    """sha256 over every leaf's raw bytes (in path order) and the float64 sum of |leaf|."""
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    digest, total = hashlib.sha256(), 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        array = np.asarray(jax.device_get(leaf))
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(array.tobytes())
        total += float(np.abs(array.astype(np.float64)).sum())
    return {"sha256": digest.hexdigest(), "abs_sum": total}


def _losses(workdir: str) -> list[float]:
    from tupe_jax.metrics import read_metrics  # pylint: disable=import-outside-toplevel
    return [float(m["loss"]) for m in read_metrics(workdir) if "loss" in m and "split" not in m]


# The loops under test. After the redesign these are the only lines that name the loops' modules.
def pretrain_config(pe: str, objective: str, cache_dir: str):
    from tupe_jax.config import apply_overrides  # pylint: disable=import-outside-toplevel
    from configs import pretrain as cfg  # pylint: disable=import-outside-toplevel
    config = cfg.get_config(f"pe={pe},size=tiny,objective={objective}")
    apply_overrides(config, PRETRAIN)
    with config.unlocked():
        config.data.cache_dir = cache_dir
    return config


def run_pretrain(config, workdir: str) -> dict:
    import jax  # pylint: disable=import-outside-toplevel
    from tupe_jax import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
    from tupe_jax.pretrain import loop  # pylint: disable=import-outside-toplevel
    loop.pretrain(config, workdir, devices=jax.devices()[:1])
    return {"losses": _losses(workdir), "params": checksum(workdir_lib.load_run(workdir).params)}


def run_finetune(pretrain_workdir: str, workdir: str, cache_dir: str) -> dict:
    import jax  # pylint: disable=import-outside-toplevel
    from tupe_jax import checkpoint as ckpt_lib  # pylint: disable=import-outside-toplevel
    from tupe_jax.config import apply_overrides, load_config  # pylint: disable=import-outside-toplevel
    from tupe_jax.finetune import loop  # pylint: disable=import-outside-toplevel
    config = load_config(os.path.join(ROOT, "configs", "glue.py") + ":task=wordorder,pe=tupe_r,size=tiny")
    apply_overrides(config, FINETUNE)
    with config.unlocked():
        config.data.cache_dir = cache_dir
        config.init_from = pretrain_workdir
    loop.finetune(config, workdir, devices=jax.devices()[:1])
    with ckpt_lib.Checkpointer(workdir, read_only=True, async_=False) as checkpointer:
        step = checkpointer.latest_step()
    params = ckpt_lib.restore_params(workdir, step)
    return {"losses": _losses(workdir), "params": checksum(params)}


def record(root: str, schemes=SCHEMES, objectives=OBJECTIVES, finetune: bool = True) -> dict:
    """Run the loops under `root` and return the fingerprint (at one of `COMPILES` only)."""
    compile_kind()
    cache = os.path.join(root, "cache")
    os.environ["TUPE_JAX_CACHE"] = cache
    out: dict = {"stack": stack(), "pretrain": {}, "finetune": {}}
    for objective in objectives:
        for pe in schemes:
            name = f"{pe}-{objective}"
            print(f"behaviour: {name}", flush=True)
            out["pretrain"][name] = run_pretrain(pretrain_config(pe, objective, cache), os.path.join(root, name))
    if finetune:
        pre = os.path.join(root, "tupe_r-mlm")
        if not os.path.isdir(pre):
            run_pretrain(pretrain_config("tupe_r", "mlm", cache), pre)
        print("behaviour: finetune wordorder from tupe_r-mlm", flush=True)
        out["finetune"]["wordorder-tupe_r"] = run_finetune(pre, os.path.join(root, "ft"), cache)
    return out


def record_at(root: str, schemes=SCHEMES, objectives=OBJECTIVES, finetune: bool = True,
              compile: str = "default") -> dict:  # pylint: disable=redefined-builtin
    """`record` in a fresh process compiled as `COMPILES[compile]`, from a test process whose own flags are the
    suite's (tests/conftest.py)."""
    out = os.path.join(root, "record.json")
    code = ("import json, sys; from tests import behaviour as B; a = sys.argv[1:]; json.dump(B.record(a[0], "
            "tuple(a[1].split(',')), tuple(a[2].split(',')), a[3] == '1'), open(a[4], 'w', encoding='utf-8'))")
    subprocess.run([sys.executable, "-c", code, root, ",".join(schemes), ",".join(objectives), str(int(finetune)), out],
                   cwd=ROOT, env={**os.environ, "XLA_FLAGS": COMPILES[compile]}, check=True, timeout=3000)
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def _write(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {path}")


def main(argv: list[str]) -> None:
    mode = argv[1] if len(argv) == 2 else ""
    if mode not in ("--write", "--add", "--add-fast"):
        sys.exit("usage: python tests/behaviour.py --write|--add|--add-fast   (module docstring)")
    if mode == "--add-fast":    # before jax reads the flags (nothing here has started a backend yet)
        os.environ["XLA_FLAGS"] = COMPILES["fast"]
    if mode in ("--write", "--add-fast"):   # recorded as the suite runs (XLA's dots: tests/conftest.py), so that
        os.environ[xla_options.OPT_OUT] = "0"   # the suite's stack can match them bit for bit
    primary = recordings()[0] if mode != "--write" else None
    if primary is not None and primary["stack"] == stack():
        sys.exit(f"error: this stack is the primary recording's, {GOLDEN}, nothing to add (--write re-records it)")
    new = sorted({f"{pe}-{o}" for pe in SCHEMES for o in OBJECTIVES} - set(primary["pretrain"])) if primary else []
    if new:                     # before minutes of recording: another CPU kind's numbers cannot be compared to none
        sys.exit(f"error: {', '.join(new)} not in {GOLDEN} (a scheme added since it was recorded), nothing "
                 "recorded, use --write")
    with tempfile.TemporaryDirectory() as tmp:
        result = record(tmp)
    short = [name for kind in ("pretrain", "finetune") for name, r in result[kind].items()
             if len(r["losses"]) != STEPS]
    if short:   # e.g. a SIGTERM: the loop's preemption handler ends that run and every later one early
        sys.exit(f"error: {', '.join(short)} logged fewer than {STEPS} steps, nothing written, record again undisturbed")
    if primary is None:
        for path in glob.glob(os.path.join(os.path.dirname(GOLDEN), "behaviour-*.json")):
            os.remove(path)
            print(f"removed {path} (recorded with the numbers before)")
        _write(GOLDEN, result)
        return
    moved = [name for kind in ("pretrain", "finetune") for name in result[kind]
             if not agrees(result[kind][name], primary[kind][name])]
    if moved:
        sys.exit(f"error: {', '.join(moved)} moved beyond 1e-5 of {GOLDEN}, nothing written, the numbers changed: "
                 "use --write")
    _write(recording_path(result["stack"]), result)


if __name__ == "__main__":
    main(sys.argv)
