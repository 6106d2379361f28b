"""Config loading, command-line overrides, validation and the workdir's `config.json`.

A config is a locked `ml_collections.ConfigDict` built by `configs/<name>.py:get_config(arg)`. Overrides
(`--config.a.b=c`) are parsed against the type of the existing value: unknown keys and values of the wrong type
raise `UserError` naming the key. `validate(config, num_devices)` checks everything that can be checked before
any compute (mesh shape, batch divisibility, model shape, known names) and raises `UserError` naming the key.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import math
import os
from typing import Any, Mapping

import ml_collections

from tupe_jax.errors import UserError, require

PE_SCHEMES = ("bert_a", "sinusoidal", "rope", "alibi", "t5", "bert_r", "nopos", "tupe_a", "tupe_r", "bert_ad")
PE_ALIASES = {"learned": "bert_a"}
OBJECTIVES = ("mlm", "clm")
# PRNG implementations for dropout masks (`train.dropout_rng`, see optim.dropout_key)
DROPOUT_RNGS = ("threefry2x32", "rbg", "unsafe_rbg")
DTYPES = ("float32", "bfloat16", "float16")
ROPE_STYLES = ("half", "interleaved")
TUPE_FORMS = ("bias", "concat")
ATTENTION_BACKENDS = ("einsum", "xla", "cudnn")
MESH_AXES = ("data", "fsdp", "tensor")
# Sections that define "the same run": a workdir refuses a config that differs in these.
RUN_IDENTITY_SECTIONS = ("model", "data")


def lock(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Lock `config` (no new keys) and return it."""
    config.lock()
    return config


def parse_arg(arg: str | None, **defaults: Any) -> ml_collections.ConfigDict:
    """Parse a big_vision style config arg "k1=v1,k2=v2" against `defaults` (values converted to their types).

    A bare word `k` sets a bool default to True; a bare first value sets the first default.
    """
    result = ml_collections.ConfigDict(dict(defaults))
    names = list(defaults)
    for i, item in enumerate(p.strip() for p in (arg or "").split(",") if p.strip()):
        key, sep, raw = item.partition("=")
        if not sep:
            if key in defaults and isinstance(defaults[key], bool):
                key, raw = key, "true"
            elif i == 0 and names:
                key, raw = names[0], item
            else:
                raise UserError(f"config arg {item!r} has no value", "--config=FILE:key=value",
                                "write it as key=value")
        key = key.strip()
        if key not in defaults:
            raise UserError(f"unknown config arg {key!r}", "--config=FILE:" + item,
                            "use one of " + ", ".join(names))
        result[key] = parse_value(raw.strip(), defaults[key], f"--config=FILE:{key}")
    return result


def parse_value(raw: str, current: Any, where: str) -> Any:
    """Convert the string `raw` to the type of `current`; raise `UserError` naming `where` if impossible."""
    def bad(kind: str) -> UserError:
        return UserError(f"{raw!r} is not {kind}", where, f"give {kind} (the current value is {current!r})")

    if isinstance(current, bool):
        lowered = raw.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise bad("a bool")
    if isinstance(current, int):
        try:
            return int(raw.replace("_", ""))
        except ValueError:
            try:
                as_float = float(raw)
            except ValueError:
                raise bad("an int") from None
            if as_float.is_integer():
                return int(as_float)
            raise bad("an int") from None
    if isinstance(current, float):
        try:
            return float(raw)
        except ValueError:
            raise bad("a float") from None
    if isinstance(current, str):
        return raw
    if isinstance(current, (tuple, list)) or current is None:
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            if current is None:
                return raw
            raise bad("a Python literal list/tuple") from None
        if current is not None and not isinstance(value, (tuple, list)):
            raise bad("a list/tuple")
        return type(current)(value) if current is not None else value
    raise UserError(f"key of type {type(current).__name__} cannot be set from the command line", where,
                    "edit the config file instead")


def apply_overrides(config: ml_collections.ConfigDict, overrides: Mapping[str, str]) -> ml_collections.ConfigDict:
    """Apply {"train.steps": "200", ...} (string values) to the locked `config` in place and return it."""
    for dotted, raw in overrides.items():
        where = f"--config.{dotted}"
        *parents, leaf = dotted.split(".")
        node = config
        for depth, name in enumerate(parents):
            if not isinstance(node, ml_collections.ConfigDict) or name not in node:
                known = ", ".join(sorted(node.keys())) if isinstance(node, ml_collections.ConfigDict) else ""
                section = ".".join(parents[:depth]) or "config"
                raise UserError(f"unknown config key {dotted!r}", where,
                                f"{section} has: {known}" if known else "check the spelling")
            node = node[name]
        if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
            known = ", ".join(sorted(node.keys())) if isinstance(node, ml_collections.ConfigDict) else ""
            raise UserError(f"unknown config key {dotted!r}", where,
                            f"{'.'.join(parents) or 'config'} has: {known}" if known else "check the spelling")
        current = node[leaf]
        if isinstance(current, ml_collections.ConfigDict):
            raise UserError(f"{dotted!r} is a section, not a value", where,
                            "set one of its keys: " + ", ".join(sorted(current.keys())))
        value = parse_value(raw, current, where)
        try:
            node[leaf] = value
        except (TypeError, AttributeError) as err:
            raise UserError(f"cannot set {dotted} to {raw!r} ({err})", where, "give a value of the same type") from None
    return config


def load_config(spec: str) -> ml_collections.ConfigDict:
    """Load "path/to/config.py[:arg]" by calling its `get_config(arg)`; the result is locked."""
    path, _, arg = spec.partition(":")
    require(bool(path), "no config file given", "--config", "pass --config=configs/pretrain.py:pe=tupe_r,size=tiny")
    require(os.path.isfile(path), f"config file {path!r} does not exist", "--config",
            "give a path like configs/pretrain.py (relative to the current directory)")
    module_name = "tupe_config_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:10]
    spec_obj = importlib.util.spec_from_file_location(module_name, path)
    require(spec_obj is not None and spec_obj.loader is not None, f"cannot import {path!r}", "--config",
            "give a Python file with get_config(arg)")
    module = importlib.util.module_from_spec(spec_obj)
    spec_obj.loader.exec_module(module)  # type: ignore[union-attr]
    require(hasattr(module, "get_config"), f"{path} has no get_config(arg)", "--config", "define get_config(arg)")
    config = module.get_config(arg or None)
    config.lock()
    return config


def resolve_mesh_shape(mesh: Mapping[str, int], num_devices: int) -> tuple[int, int, int]:
    """Return (data, fsdp, tensor) with at most one -1 filled so the product equals `num_devices`."""
    sizes = [int(mesh[a]) for a in MESH_AXES]
    fill = [a for a, s in zip(MESH_AXES, sizes) if s == -1]
    for axis, size in zip(MESH_AXES, sizes):
        require(size == -1 or size >= 1, f"mesh.{axis} = {size} is not positive", f"--config.mesh.{axis}",
                "use a positive size or -1 to fill")
    require(len(fill) <= 1, f"more than one mesh axis is -1 ({', '.join(fill)})", f"--config.mesh.{fill[-1]}" if fill else "",
            "give at most one axis -1")
    known = math.prod(s for s in sizes if s != -1)
    if fill:
        require(num_devices % known == 0,
                f"mesh axes other than {fill[0]} multiply to {known}, which does not divide the {num_devices} devices",
                f"--config.mesh.{fill[0]}", "make the fixed axes divide the device count")
        sizes = [num_devices // known if s == -1 else s for s in sizes]
    product = math.prod(sizes)
    require(product == num_devices, f"mesh data*fsdp*tensor = {product} does not equal the {num_devices} devices",
            "--config.mesh.data", "set it to -1 to fill")
    return tuple(sizes)  # type: ignore[return-value]


def _positive(config: ml_collections.ConfigDict, keys: tuple[str, ...], allow_zero: bool = False) -> None:
    for dotted in keys:
        section, name = dotted.split(".")
        value = config[section][name]
        ok = value >= 0 if allow_zero else value > 0
        require(ok, f"{dotted} = {value} must be {'>= 0' if allow_zero else 'positive'}", f"--config.{dotted}",
                "give a " + ("non-negative" if allow_zero else "positive") + " value")


def require_one_of(value: Any, known: tuple[str, ...], key: str) -> None:
    require(value in known, f"unknown {key} {value!r}", f"--config.{key}", "use one of " + "|".join(known))


def validate_model(model: ml_collections.ConfigDict) -> None:
    """Check the model section (shape, names, positional-scheme settings)."""
    cfg = ml_collections.ConfigDict({"model": model.to_dict()})
    _positive(cfg, ("model.num_layers", "model.hidden_size", "model.num_heads", "model.mlp_dim",
                    "model.vocab_size", "model.max_len", "model.rope_base", "model.layer_norm_eps"))
    require_one_of(PE_ALIASES.get(model.pe, model.pe), PE_SCHEMES, "model.pe")
    require_one_of(model.objective, OBJECTIVES, "model.objective")
    require_one_of(model.dtype, DTYPES, "model.dtype")
    require_one_of(model.rope_style, ROPE_STYLES, "model.rope_style")
    require_one_of(model.tupe_form, TUPE_FORMS, "model.tupe_form")
    require_one_of(model.attention_backend, ATTENTION_BACKENDS, "model.attention_backend")
    require(model.hidden_size % model.num_heads == 0,
            f"model.hidden_size = {model.hidden_size} is not divisible by model.num_heads = {model.num_heads}",
            "--config.model.num_heads", "pick a head count that divides hidden_size")
    for key in ("dropout_rate", "attention_dropout_rate"):
        require(0.0 <= model[key] < 1.0, f"model.{key} = {model[key]} is outside [0, 1)", f"--config.model.{key}",
                "give a rate in [0, 1)")
    require(0.0 < model.rope_fraction <= 1.0, f"model.rope_fraction = {model.rope_fraction} is outside (0, 1]",
            "--config.model.rope_fraction", "give a fraction in (0, 1]")
    head_dim = model.hidden_size // model.num_heads
    rotary = int(head_dim * model.rope_fraction)
    require(model.pe != "rope" or (rotary >= 2 and rotary % 2 == 0),
            f"rope rotates {rotary} of {head_dim} head dims, which must be even and >= 2",
            "--config.model.rope_fraction", "pick a fraction giving an even number of dims")
    require(model.rel_num_buckets >= 4 and model.rel_num_buckets % 2 == 0,
            f"model.rel_num_buckets = {model.rel_num_buckets} must be even and >= 4", "--config.model.rel_num_buckets",
            "use e.g. 32")
    require(model.rel_max_distance > model.rel_num_buckets // 2,
            f"model.rel_max_distance = {model.rel_max_distance} must exceed rel_num_buckets/2 = "
            f"{model.rel_num_buckets // 2} (the exact-distance buckets)", "--config.model.rel_max_distance",
            "use e.g. 128 with 32 buckets")
    require(not (model.objective == "clm" and model.untie_cls),
            "model.untie_cls must be False for objective=clm (no [CLS] to untie)", "--config.model.untie_cls",
            "set it to false")


def validate(config: ml_collections.ConfigDict, num_devices: int) -> tuple[int, int, int]:
    """Check `config` against `num_devices` before any compute; return the resolved mesh (data, fsdp, tensor)."""
    if "task" in config and "sweep" in config:   # a fine-tuning config (configs/glue.py)
        from tupe_jax.finetune_lib import validate_glue  # pylint: disable=import-outside-toplevel
        return validate_glue(config, num_devices)
    validate_model(config.model)
    data, fsdp, tensor = resolve_mesh_shape(config.mesh, num_devices)
    if "train" not in config:
        return data, fsdp, tensor
    train = config.train
    _positive(config, ("train.steps", "train.batch_size", "train.learning_rate", "train.grad_accum_steps",
                       "train.log_every", "train.adam_eps"))
    _positive(config, ("train.warmup_steps", "train.decay_steps", "train.eval_every", "train.eval_steps",
                       "train.weight_decay", "train.clip_norm"), allow_zero=True)
    for key in ("adam_b1", "adam_b2"):
        require(0.0 <= train[key] < 1.0, f"train.{key} = {train[key]} is outside [0, 1)", f"--config.train.{key}",
                "use e.g. 0.9 / 0.999")
    batch, accum, shards = train.batch_size, train.grad_accum_steps, data * fsdp
    require(batch % accum == 0, f"train.grad_accum_steps = {accum} does not divide train.batch_size = {batch}",
            "--config.train.grad_accum_steps", "pick a divisor of the batch size")
    require((batch // accum) % shards == 0,
            f"train.batch_size = {batch} (microbatch {batch // accum}) is not divisible by the data-parallel size "
            f"mesh.data*mesh.fsdp = {shards}", "--config.train.batch_size", f"use a multiple of {shards * accum}")
    if "dropout_rng" in train:
        require_one_of(train.dropout_rng, DROPOUT_RNGS, "train.dropout_rng")
    if "checkpoint" in config:
        _positive(config, ("checkpoint.every", "checkpoint.keep"))
    if "data" in config and config.model.objective == "mlm" and "mask_prob" in config.data:
        require(0.0 < config.data.mask_prob < 1.0, f"data.mask_prob = {config.data.mask_prob} is outside (0, 1)",
                "--config.data.mask_prob", "use e.g. 0.15")
        require(0 <= config.data.max_predictions <= config.model.max_len,
                f"data.max_predictions = {config.data.max_predictions} is outside [0, model.max_len]",
                "--config.data.max_predictions", "use 0 (= ceil(mask_prob * max_len)) or e.g. 20 for max_len 128")
    return data, fsdp, tensor


def to_json(config: ml_collections.ConfigDict) -> str:
    """The resolved config as sorted, indented JSON."""
    return json.dumps(config.to_dict(), indent=2, sort_keys=True, default=str)


def config_hash(config: ml_collections.ConfigDict | Mapping[str, Any],
                sections: tuple[str, ...] = RUN_IDENTITY_SECTIONS) -> str:
    """A short stable hash of the run-identity sections (model and data)."""
    as_dict = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else dict(config)
    picked = {s: as_dict.get(s) for s in sections}
    return hashlib.sha256(json.dumps(picked, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_differences(old: Mapping[str, Any], new: Mapping[str, Any],
                       sections: tuple[str, ...] = RUN_IDENTITY_SECTIONS) -> list[str]:
    """Keys under `sections` whose values differ, as "key: old -> new" strings."""
    def normal(tree: Mapping[str, Any]) -> dict[str, Any]:  # JSON round trip: tuples → lists, as on disk
        return _flatten(json.loads(json.dumps({s: tree.get(s, {}) for s in sections}, default=str)))
    flat_old, flat_new = normal(old), normal(new)
    keys = sorted(set(flat_old) | set(flat_new))
    return [f"{k}: {flat_old.get(k)!r} -> {flat_new.get(k)!r}" for k in keys if flat_old.get(k) != flat_new.get(k)]


def load_workdir_config(workdir: str) -> ml_collections.ConfigDict:
    """Read `workdir/config.json` back into a locked ConfigDict."""
    path = os.path.join(workdir, "config.json")
    require(os.path.isfile(path), f"{path} does not exist", "--workdir", "point it at a run made by `launch pretrain`")
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as err:
            raise UserError(f"{path} is not valid JSON ({err.msg}, line {err.lineno})", "--workdir",
                            "restore it or start a fresh workdir") from None
    return lock(ml_collections.ConfigDict(data))


def write_workdir_config(workdir: str, config: ml_collections.ConfigDict, overwrite: bool = False,
                         write: bool = True) -> None:
    """Write `workdir/config.json`, refusing one that holds another run's model/data config unless `overwrite`.

    With `write=False` (processes other than 0) only the check runs.
    """
    path = os.path.join(workdir, "config.json")
    if os.path.isfile(path) and not overwrite:
        with open(path, encoding="utf-8") as f:
            try:
                old = json.load(f)
            except json.JSONDecodeError:
                old = {}
        diffs = config_differences(old, config.to_dict())
        if diffs:
            shown = "; ".join(diffs[:3]) + (f"; and {len(diffs) - 3} more" if len(diffs) > 3 else "")
            raise UserError(f"{path} holds another run's config ({shown})", "--workdir",
                            "use a fresh workdir, or pass --overwrite_config to replace it")
    if not write:
        return
    os.makedirs(workdir, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(to_json(config) + "\n")
    os.replace(tmp, path)
