"""Whether this machine's XLA computes the gradients of a small tied-embedding MLM head the same on every 8-device
mesh of ('data', 'fsdp', 'tensor'). On XLA:CPU (jax/jaxlib 0.10.2, 8 fake devices) the (2, 2, 2) mesh gives wrong
gradients while the loss is right and every other mesh agrees with one device (tests/test_mesh_gradients.py); the
repro is pure JAX (a gather of the labels' logits under a tied output projection), for an upstream report.

    python tools/mesh_gradient_check.py [--json FILE]     # exit 1 when a mesh disagrees

On a machine without 8 accelerators it checks XLA:CPU with 8 fake devices (set before JAX starts).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

if "jax" not in sys.modules and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

MESHES = ((2, 2, 2), (4, 2, 1), (1, 2, 4), (8, 1, 1), (2, 1, 4))
TOLERANCE = 1e-4     # relative to the largest gradient entry (float32 sums in another order stay near 1e-6)


def _ln(h):
    m = h.mean(-1, keepdims=True)
    v = ((h - m) ** 2).mean(-1, keepdims=True)
    return (h - m) * jax.lax.rsqrt(v + 1e-5)


def loss(emb, w, tokens, labels):
    """Embedding + LayerNorm, 4 prediction slots, a dense + tanh + LayerNorm head, logits against the same
    embedding, and the labels' log-probabilities gathered."""
    h = _ln(jnp.take(emb, tokens, axis=0))[:, :4]
    logits = _ln(jnp.tanh(h @ w)) @ emb.T
    return -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1))


def check(devices=None) -> dict:
    """{mesh: relative max |gradient − one device's|} on 8 `devices` (default: the first 8)."""
    devices = list(devices or jax.devices())[:8]
    if len(devices) < 8:
        raise SystemExit(f"error: {len(devices)} devices, tools/mesh_gradient_check.py, run it where JAX sees 8 "
                         "(or with no accelerator: 8 fake CPU devices)")
    r = np.random.default_rng(0)
    emb = (r.normal(size=(64, 32)) * 0.02).astype(np.float32)
    w = (r.normal(size=(32, 32)) * 0.02).astype(np.float32)
    tokens = r.integers(5, 64, (8, 16)).astype(np.int32)
    labels = r.integers(5, 64, (8, 4)).astype(np.int32)
    ref = jax.device_get(jax.jit(jax.grad(loss, (0, 1)))(emb, w, tokens, labels))   # one device
    scale = max(float(np.abs(g).max()) for g in ref)
    out = {}
    for shape in MESHES:
        mesh = jax.make_mesh(shape, ("data", "fsdp", "tensor"), devices=devices)
        batch = NamedSharding(mesh, P(("data", "fsdp")))
        params = (NamedSharding(mesh, P("tensor", "fsdp")), NamedSharding(mesh, P("fsdp", "tensor")))
        got = jax.jit(jax.grad(loss, (0, 1)), in_shardings=(*params, batch, batch))(emb, w, tokens, labels)
        out["x".join(map(str, shape))] = max(float(np.abs(np.asarray(a) - b).max()) for a, b in zip(got, ref)) / scale
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="", help="also write the result here")
    args = parser.parse_args()
    errors = check()
    wrong = sorted(k for k, v in errors.items() if v > TOLERANCE)
    result = {"command": " ".join(["python tools/mesh_gradient_check.py", *sys.argv[1:]]),
              "platform": jax.default_backend(), "jax": jax.__version__, "device_kind": jax.devices()[0].device_kind,
              "relative_error": errors, "tolerance": TOLERANCE, "wrong_meshes": wrong}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
