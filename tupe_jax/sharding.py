"""Device mesh, the logical→mesh axis rules (one table), and sharded state / batch helpers.

Parameters are created in the model with `nn.with_logical_partitioning(init, ('embed', 'mlp'))`, so
`jax.eval_shape(init)` yields boxed `nn.LogicallyPartitioned` leaves. `logical_to_shardings` maps them through
`LOGICAL_RULES` to `NamedSharding`s on the ('data', 'fsdp', 'tensor') mesh; a dimension that its mesh axes do not
divide is replicated instead (logged once). Unboxed leaves (optimizer counters, step, rng) are replicated.
Activations are pinned by the same rules: the model calls `constrain(x, ('batch', 'length', 'embed'))` etc., which
acts only inside a function wrapped by `with_activation_layout(fn, mesh)` (the Trainer's step, the eval steps).
"""
from __future__ import annotations

import contextvars
import functools
import logging
import math
import re
from typing import Any, Callable, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from tupe_jax.errors import require, warn_once

log = logging.getLogger(__name__)
MESH_AXES = ("data", "fsdp", "tensor")

# The ONE logical→mesh table. Params: embed→fsdp (ZeRO-3 style), mlp/heads/vocab→tensor (Megatron style).
# Activations: batch over every data-parallel axis (embed then stays whole: fsdp is taken); sequence length and
# per-head dims stay whole.
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


def warn_miscompiled_mesh(mesh: tuple[int, int, int], platform: str) -> None:
    """On XLA:CPU (jaxlib 0.10.2) a mesh with data, fsdp and tensor all > 1 gave wrong gradients for some shapes of
    an MLM head, the loss itself right (`python tools/mesh_gradient_check.py`, tests/test_mesh_gradients.py): said
    once, since other shapes (this project's tests among them) train correctly there."""
    if platform == "cpu" and min(mesh) > 1:
        warn_once(f"warning: mesh (data, fsdp, tensor) = {tuple(mesh)} on XLA:CPU: jaxlib 0.10.2 computes wrong "
                  "gradients for some MLM shapes when all three axes are > 1 (tools/mesh_gradient_check.py); use at "
                  "most two axes > 1 here")


def resolve_mesh_shape(mesh: Mapping[str, int], num_devices: int) -> tuple[int, int, int]:
    """Return (data, fsdp, tensor) with at most one -1 filled so the product equals `num_devices`."""
    sizes = [int(mesh[a]) for a in MESH_AXES]
    fill = [a for a, s in zip(MESH_AXES, sizes) if s == -1]
    for axis, size in zip(MESH_AXES, sizes):
        require(size == -1 or size >= 1, f"mesh.{axis} = {size} is not positive", f"--config.mesh.{axis}",
                "use a positive size or -1 to fill")
    require(len(fill) <= 1, f"more than one mesh axis is -1 ({', '.join(fill)})",
            f"--config.mesh.{fill[-1]}" if fill else "", "give at most one axis -1")
    known = math.prod(s for s in sizes if s != -1)
    if fill:
        fixed = [a for a in MESH_AXES if a != fill[0]]
        require(num_devices % known == 0,
                f"mesh axes other than {fill[0]} multiply to {known}, which does not divide the {num_devices} devices",
                "/".join(f"--config.mesh.{a}" for a in fixed), f"make mesh.{fixed[0]} x mesh.{fixed[1]} divide "
                f"{num_devices}")
        sizes = [num_devices // known if s == -1 else s for s in sizes]
    product = math.prod(sizes)
    require(product == num_devices, f"mesh data*fsdp*tensor = {product} does not equal the {num_devices} devices",
            "--config.mesh.data", "set it to -1 to fill")
    return tuple(sizes)  # type: ignore[return-value]


def check_batch(train: Any, mesh_shape: tuple[int, int, int]) -> None:
    """`train.batch_size` must split into `train.grad_accum_steps` microbatches that divide over data*fsdp (and
    `train.eval_batch_size`, where the section has one, over data*fsdp)."""
    batch, accum, shards = int(train.batch_size), int(train.grad_accum_steps), mesh_shape[0] * mesh_shape[1]
    require(batch % accum == 0, f"train.grad_accum_steps = {accum} does not divide train.batch_size = {batch}",
            "--config.train.grad_accum_steps", "pick a divisor of the batch size")
    require((batch // accum) % shards == 0,
            f"train.batch_size = {batch} (microbatch {batch // accum}) is not divisible by the data-parallel size "
            f"mesh.data*mesh.fsdp = {shards}", "--config.train.batch_size", f"use a multiple of {shards * accum} (a "
            f"resumed run keeps its batch size: run it where mesh.data*mesh.fsdp divides {batch // accum})")
    if "eval_batch_size" in train:
        require(int(train.eval_batch_size) % shards == 0,
                f"train.eval_batch_size = {train.eval_batch_size} is not divisible by mesh.data*mesh.fsdp = {shards}",
                "--config.train.eval_batch_size", f"use a multiple of {shards}")


def _divisors(n: int) -> str:
    """The divisors of `n`, as a comma list."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_model(model: Any, mesh_shape: tuple[int, int, int]) -> None:
    """The model's dimensions must split over the mesh where a split is the point of the axis: `hidden_size` (embed,
    in every weight) over fsdp, `num_heads` and `mlp_dim` over tensor; otherwise `fit_spec` would replicate them
    and each device hold those weights and their Adam moments whole. The vocabulary may not split (BERT's 30522
    rows over tensor 4): that table is replicated, said once."""
    fsdp, tensor, devices = mesh_shape[1], mesh_shape[2], math.prod(mesh_shape)
    hidden, heads, mlp = int(model.hidden_size), int(model.num_heads), int(model.mlp_dim)
    # a value that may replace an axis divides its dims and the devices the other split axis leaves (data: the rest)
    require(hidden % fsdp == 0, f"model.hidden_size = {hidden} is not divisible by mesh.fsdp = {fsdp}: fsdp splits "
            "every weight along hidden_size, so each device would hold the whole model", "--config.mesh.fsdp",
            f"use a divisor of {hidden} ({_divisors(math.gcd(hidden, devices // tensor))}) and give the other "
            "devices to mesh.data")
    require(heads % tensor == 0 and mlp % tensor == 0, f"model.num_heads = {heads} and model.mlp_dim = {mlp} are "
            f"not both divisible by mesh.tensor = {tensor}: attention or MLP weights would be replicated on every "
            "tensor device", "--config.mesh.tensor",
            f"use a common divisor ({_divisors(math.gcd(heads, mlp, devices // fsdp))}) and give the other devices to "
            "mesh.data")


def make_mesh(config: Any, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh ('data', 'fsdp', 'tensor') sized from `config.mesh` (a -1 axis fills the remaining devices)."""
    devices = list(devices) if devices is not None else jax.devices()
    mesh_cfg = config.mesh if hasattr(config, "mesh") else config
    shape = resolve_mesh_shape(mesh_cfg, len(devices))
    mesh = jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)
    check_rows_per_process(np.vectorize(lambda d: d.process_index)(mesh.devices), shape)
    return mesh


def check_rows_per_process(processes: np.ndarray, shape: tuple[int, ...]) -> None:
    """Each process must hold rows of the batch that no other process holds, as many as every other one.

    `processes`: the process index of each mesh position, shaped (data, fsdp, tensor). A batch's row block
    (data, fsdp) lives on the `tensor` devices of that position; every process loads its own rows
    (`global_batch`), so a block spread over two processes (a tensor axis wider than a host's devices) would be
    assembled from two different sets of rows, and JAX takes that as one array without a word."""
    blocks = processes.reshape(shape[0] * shape[1], shape[2])
    split = [b for b in range(blocks.shape[0]) if len(set(blocks[b].tolist())) > 1]
    require(not split, f"batch row block {split[0] if split else 0} of mesh {tuple(shape)} (data, fsdp, tensor) lies "
            f"on the devices of processes {sorted(set(blocks[split[0]].tolist())) if split else []}: each process "
            "loads its own rows", "--config.mesh.tensor", "make mesh.tensor at most the devices of one host (and "
            "a divisor of it)")
    counts = np.bincount(blocks[:, 0], minlength=int(processes.max()) + 1)
    require(len(set(counts.tolist())) == 1, f"the processes hold {sorted(set(counts.tolist()))} batch row blocks "
            f"each on mesh {tuple(shape)}", "--config.mesh", "give every host the same number of devices")


_LAYOUT_MESH: contextvars.ContextVar[Optional[Mesh]] = contextvars.ContextVar("activation_layout", default=None)


def with_activation_layout(fn: Callable, mesh: Mesh) -> Callable:
    """`fn` traced with `mesh` in scope, so that the model's `constrain` calls pin its activations (batch over
    data x fsdp, heads and mlp over tensor) instead of leaving them to XLA's propagation. Wrap before `jax.jit`."""
    @functools.wraps(fn)
    def laid_out(*args: Any, **kwargs: Any) -> Any:
        token = _LAYOUT_MESH.set(mesh)
        try:
            return fn(*args, **kwargs)
        finally:
            _LAYOUT_MESH.reset(token)
    return laid_out


def tensor_parallel() -> bool:
    """Whether the `with_activation_layout` mesh being traced splits heads and mlp over `tensor` (> 1 device)."""
    mesh = _LAYOUT_MESH.get()
    return mesh is not None and mesh.shape["tensor"] > 1


def constrain(x: jax.Array, names: Sequence[Optional[str]]) -> jax.Array:
    """Activation `x` (one logical name per dim, e.g. ('batch', 'length', 'embed')) laid out as LOGICAL_RULES map
    `names`, a dimension its mesh axes do not divide left whole; `x` itself outside `with_activation_layout` (one
    device, evaluation tools, analyses, export) and on a one-device mesh (the CPU benchmark's step is traced as
    before: no constraint left for XLA to handle)."""
    mesh = _LAYOUT_MESH.get()
    if mesh is None or mesh.size == 1:
        return x
    spec = nn.logical_to_mesh_axes(tuple(names), LOGICAL_RULES)
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, fit_spec(P(*spec), x.shape, mesh, f"activation {tuple(names)}")))


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


def param_name(path: Sequence[Any]) -> str:
    """'encoder/blocks_*/mlp_in/kernel' for a leaf's tree path: the state's top keys (params, opt_state), the
    optimizer's wrappers and the layer number dropped, so that a parameter and its moments in every layer read
    alike (one log line each)."""
    keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
    keys = keys[1:] if keys and keys[0] in ("params", "opt_state") else keys
    return "/".join(re.sub(r"^blocks_\d+$", "blocks_*", k) for k in keys) or jax.tree_util.keystr(path)


def logical_to_shardings(abstract_tree: Any, mesh: Mesh,
                         rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> Any:
    """NamedShardings for a (possibly boxed) abstract tree; the result has the UNBOXED tree's structure.

    Logical specs come from `nn.get_partition_spec`, are mapped with `nn.logical_to_mesh_axes(rules)`, then
    fitted to each leaf's shape (`fit_spec`).
    """
    logical_specs = nn.get_partition_spec(abstract_tree)
    unboxed = nn.meta.unbox(abstract_tree)

    def one(path: Any, leaf: Any, spec: P) -> NamedSharding:
        where = param_name(path)
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


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Global arrays replicated over `mesh` from a tree of which every process holds the same copy (NumPy, or on
    one of its own devices): each process fills only its own devices, so it works across hosts, where
    `jax.device_put` of one process's array cannot."""
    sharding = replicated(mesh)
    return jax.tree_util.tree_map(
        lambda v: jax.make_array_from_callback(np.shape(v), sharding, lambda index, v=np.asarray(v): v[index]), tree)


def global_batch(local_batch: Any, mesh: Mesh) -> Any:
    """Assemble global arrays from this process's rows (global batch = process_count × local rows); any pytree of
    arrays (a typed batch from `data.batch`, or a dict)."""
    sharding = batch_sharding(mesh)
    return jax.tree_util.tree_map(lambda v: jax.make_array_from_process_local_data(sharding, np.asarray(v)),
                                  local_batch)


def local_batch_size(global_batch_size: int) -> int:
    """Rows this process must load for a global batch of `global_batch_size`."""
    return global_batch_size // jax.process_count()


def gathered(value: int) -> list[int]:
    """Every process's int `value`, in process order (a collective call with several processes: all must make it)."""
    if jax.process_count() == 1:
        return [value]
    return [int(v) for v in np.asarray(multihost_utils.process_allgather(np.asarray([value], np.int32))).ravel()]
