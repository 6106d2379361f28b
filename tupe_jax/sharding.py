"""Device mesh, the logical→mesh axis rules (one table), and sharded state / batch helpers.

Parameters are created in the model with `nn.with_logical_partitioning(init, ('embed', 'mlp'))`, so
`jax.eval_shape(init)` yields boxed `nn.LogicallyPartitioned` leaves. `logical_to_shardings` maps them through
`LOGICAL_RULES` to `NamedSharding`s on the ('data', 'fsdp', 'tensor') mesh; a dimension that its mesh axes do not
divide is replicated instead (logged once). Unboxed leaves (optimizer counters, step, rng) are replicated.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from tupe_jax.config import MESH_AXES, resolve_mesh_shape

log = logging.getLogger(__name__)

# The ONE logical→mesh table. Params: embed→fsdp (ZeRO-3 style), mlp/heads/vocab→tensor (Megatron style).
# Activations: batch over every data-parallel axis; sequence length and per-head dims stay whole.
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("vocab", "tensor"),
    ("kv", None),
    ("qkv", None),
    ("pos", None),
    ("buckets", None),
    ("length", None),
    ("layers", None),
)
KNOWN_LOGICAL = frozenset(name for name, _ in LOGICAL_RULES)
_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        log.warning(message)


def make_mesh(config: Any, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh ('data', 'fsdp', 'tensor') sized from `config.mesh` (a -1 axis fills the remaining devices)."""
    devices = list(devices) if devices is not None else jax.devices()
    mesh_cfg = config.mesh if hasattr(config, "mesh") else config
    shape = resolve_mesh_shape(mesh_cfg, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def axis_rules() -> Any:
    """Context manager installing LOGICAL_RULES for `nn.with_logical_constraint` inside the model."""
    return nn.logical_axis_rules(LOGICAL_RULES)


def _axes_size(mesh: Mesh, axes: str | tuple[str, ...] | None) -> int:
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(mesh.shape[a] for a in names)


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh, where: str = "") -> P:
    """Replicate the dims of mesh spec `spec` that their mesh axes do not divide (or that reuse a mesh axis)."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used: set[str] = set()
    fitted = []
    for dim, (size, axes) in enumerate(zip(shape, entries)):
        names = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
        if names and (size % _axes_size(mesh, axes) or used & set(names)):
            _log_once(f"sharding: {where or 'array'} dim {dim} (size {size}) cannot be split over mesh axes "
                      f"{names} (size {_axes_size(mesh, axes)}); replicating that dimension")
            axes, names = None, ()
        used.update(names)
        fitted.append(axes)
    while fitted and fitted[-1] is None:
        fitted.pop()
    return P(*fitted)


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.Partitioned)


def logical_to_shardings(abstract_tree: Any, mesh: Mesh,
                         rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> Any:
    """NamedShardings for a (possibly boxed) abstract tree; the result has the UNBOXED tree's structure.

    Logical specs come from `nn.get_partition_spec`, are mapped with `nn.logical_to_mesh_axes(rules)`, then
    fitted to each leaf's shape (`fit_spec`).
    """
    logical_specs = nn.get_partition_spec(abstract_tree)
    unboxed = nn.meta.unbox(abstract_tree)

    def one(path: Any, leaf: Any, spec: P) -> NamedSharding:
        where = jax.tree_util.keystr(path)
        if isinstance(leaf, nn.LogicallyPartitioned):
            unknown = [n for n in leaf.names if n is not None and n not in KNOWN_LOGICAL]
            if unknown:
                _log_once(f"sharding: logical axis names {unknown} at {where} have no rule; replicating them")
            spec = nn.logical_to_mesh_axes(spec, rules)
            shape = leaf.value.shape
        else:
            shape = getattr(nn.meta.unbox(leaf), "shape", ())
        return NamedSharding(mesh, fit_spec(P(*spec), shape, mesh, where))

    shardings = jax.tree_util.tree_map_with_path(one, abstract_tree, logical_specs, is_leaf=_is_box)
    # Boxes were leaves above, so `shardings` already has the unboxed structure; check it.
    assert jax.tree_util.tree_structure(shardings) == jax.tree_util.tree_structure(unboxed), "box structure"
    return shardings


def abstract_with_shardings(abstract_tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs (unboxed) carrying `shardings`: the target for Orbax restores."""
    return jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.meta.unbox(abstract_tree), shardings)


def create_sharded_state(init_fn: Callable[[jax.Array], Any], rng: jax.Array, mesh: Mesh,
                         rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> tuple[Any, Any]:
    """Run `init_fn(rng)` directly into its shardings; return (unboxed state, shardings).

    `init_fn` may return boxed leaves (e.g. `{'params': model.init(...)['params'], 'opt_state': tx.init(...)}`);
    eval_shape → shardings → `jax.jit(init, out_shardings=...)`, so no full copy ever sits on one device.
    """
    abstract = jax.eval_shape(init_fn, rng)
    shardings = logical_to_shardings(abstract, mesh, rules)
    state = jax.jit(lambda r: nn.meta.unbox(init_fn(r)), out_shardings=shardings)(rng)
    return state, shardings


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension over ('data', 'fsdp'); all other dims replicated."""
    return NamedSharding(mesh, P(("data", "fsdp")))


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding on `mesh`."""
    return NamedSharding(mesh, P())


def global_batch(local_batch: Mapping[str, Any], mesh: Mesh) -> dict[str, jax.Array]:
    """Assemble global arrays from this process's rows (global batch = process_count × local rows)."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()}


def local_batch_size(global_batch_size: int) -> int:
    """Rows this process must load for a global batch of `global_batch_size`."""
    return global_batch_size // jax.process_count()
