"""Generic config machinery: loading `configs/<name>.py:arg`, command-line overrides against types, locking, and
the small checks every validator uses. Nothing here knows a section or a name list: each module owns its names
and checks its own section (`model.validate_config`, `sharding.resolve_mesh_shape`, `optim.validate_config`,
`data.validate_config`), and each command owns its validator (`pretrain.validate`, `finetune.validate`,
`analysis.suite.validate`), named by the launcher's command table.

A config is a locked `ml_collections.ConfigDict` built by `configs/<name>.py:get_config(arg)`. Overrides
(`--config.a.b=c`) are parsed against the type of the existing value: unknown keys and values of the wrong type
raise `UserError` naming the key.
"""
from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.util
import json
import math
import os
import traceback
from typing import Any, Iterator, Mapping, Optional

import ml_collections

from tupe_jax.errors import UserError, require



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
    given: set[str] = set()
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
        if key in given:   # the last would silently win
            raise UserError(f"config arg {key!r} is given twice", "--config=FILE:" + item, "give it once")
        given.add(key)
        result[key] = parse_value(raw.strip(), defaults[key], f"--config=FILE:{key}")
    return result


def arg_keys(spec: str) -> frozenset[str]:
    """The keys written as `key=value` in the arg of "path/to/config.py:arg" (what the command line gave, as
    opposed to the defaults `get_config` fills in)."""
    arg = spec.partition(":")[2]
    return frozenset(item.partition("=")[0].strip() for item in arg.split(",") if "=" in item)


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
        if current:   # elements of the default's type (ints where floats are expected are fine)
            kind = type(current[0])
            ok = (int, float) if kind is float else (kind,)
            wrong = [v for v in value if not isinstance(v, ok) or (kind is not bool and isinstance(v, bool))]
            if wrong:
                raise bad(f"a list/tuple of {kind.__name__}s ({wrong[0]!r} is not)")
            value = [kind(v) for v in value]
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


def load_config(spec: str, reference: Optional[tuple[ml_collections.ConfigDict, str]] = None
                ) -> ml_collections.ConfigDict:
    """Load "path/to/config.py[:arg]" by calling its `get_config(arg)`; the result is locked. `reference`: (a
    config with the keys the command reads, the file it comes from); a file with other keys (a section missing, a
    misspelled key that nothing would read) is refused."""
    path, _, arg = spec.partition(":")
    require(bool(path), "no config file given", "--config", "pass --config=configs/pretrain.py:pe=tupe_r,size=tiny")
    require(not os.path.isdir(path), f"config file {path!r} is a folder", "--config",
            "give a Python file like configs/pretrain.py")
    require(os.path.isfile(path), f"config file {path!r} does not exist", "--config",
            "give a path like configs/pretrain.py (relative to the current directory)")
    module_name = "tupe_config_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:10]
    spec_obj = importlib.util.spec_from_file_location(module_name, path)
    require(spec_obj is not None and spec_obj.loader is not None, f"cannot import {path!r}", "--config",
            "give a Python file with get_config(arg)")
    module = importlib.util.module_from_spec(spec_obj)
    with _config_file_errors(path, "loading"):
        spec_obj.loader.exec_module(module)  # type: ignore[union-attr]
    require(hasattr(module, "get_config"), f"{path} has no get_config(arg)", "--config", "define get_config(arg)")
    with _config_file_errors(path, "get_config"):
        config = module.get_config(arg or None)
    require(isinstance(config, ml_collections.ConfigDict), f"{path}: get_config returned a {type(config).__name__}",
            "--config", "return an ml_collections.ConfigDict")
    if reference is not None:
        _same_keys(config, *reference, path)
    config.lock()
    return config


@contextlib.contextmanager
def _config_file_errors(path: str, stage: str) -> Iterator[None]:
    """A config file's own error (a syntax error, an exception in get_config) as one line naming its line."""
    try:
        yield
    except UserError:
        raise
    except SyntaxError as err:
        raise UserError(f"{path} line {err.lineno}: {err.msg}", "--config", "fix the config file") from None
    except Exception as err:  # pylint: disable=broad-except  # the user's code: any error is theirs to fix
        lines = [f.lineno for f in traceback.extract_tb(err.__traceback__)
                 if os.path.abspath(f.filename) == os.path.abspath(path)]
        where = f" line {lines[-1]}" if lines else ""
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise UserError(f"{path}{where}: {stage} raised {type(err).__name__}: {first}", "--config",
                        "fix the config file") from None


def _same_keys(config: ml_collections.ConfigDict, reference: ml_collections.ConfigDict, source: str,
               path: str) -> None:
    ours, theirs = set(flatten(config.to_dict())), set(flatten(reference.to_dict()))
    sections = sorted({k.split(".")[0] for k in theirs} - {k.split(".")[0] for k in ours})   # missing whole
    missing = [f"section {k}" for k in sections] + sorted(k for k in theirs - ours if k.split(".")[0] not in sections)
    extra = sorted(ours - theirs)
    if missing or extra:
        said = ", ".join([f"lacks {k}" for k in missing[:3]] + [f"has unknown key {k}" for k in extra[:3]])
        more = len(missing) + len(extra) - min(len(missing), 3) - min(len(extra), 3)
        raise UserError(f"{path} {said}" + (f" and {more} more" if more else ""), "--config",
                        f"start from {source}, which has every key this command reads")


def require_positive(config: ml_collections.ConfigDict, keys: tuple[str, ...], allow_zero: bool = False) -> None:
    """Each dotted key of `config` (e.g. "train.steps") must be > 0 (>= 0 with `allow_zero`)."""
    for dotted in keys:
        value = config
        for name in dotted.split("."):
            value = value[name]
        ok = value >= 0 if allow_zero else value > 0
        require(ok, f"{dotted} = {value} must be {'>= 0' if allow_zero else 'positive'}", f"--config.{dotted}",
                "give a " + ("non-negative" if allow_zero else "positive") + " value")


def require_finite(config: ml_collections.ConfigDict) -> None:
    """No float anywhere in `config` is inf or NaN (they pass every range check and poison the first step)."""
    for key, value in flatten(config.to_dict()).items():
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise UserError(f"{key} = {v} is not a finite number", f"--config.{key}", "give a finite value")


# A seed's range: `jax.random.PRNGKey` keeps the low 32 bits of its seed while 64-bit JAX is off, so seeds k and
# k + 2**32 would share their initialisation and dropout (and differ in data order only).
SEED_LIMIT = 2 ** 32


def require_seed(config: ml_collections.ConfigDict, key: str = "train.seed") -> None:
    """The seed at dotted `key` is an int in [0, 2**32) (`SEED_LIMIT`)."""
    value = config
    for name in key.split("."):
        value = value[name]
    require(0 <= int(value) < SEED_LIMIT, f"{key} = {value} is outside [0, 2**32)", f"--config.{key}",
            "give a non-negative seed below 2**32 (JAX keys keep 32 bits of a seed)")


def require_one_of(value: Any, known: tuple[str, ...], key: str) -> None:
    """`value` (of config key `key`) must be one of `known`."""
    require(value in known, f"unknown {key} {value!r}", f"--config.{key}", "use one of " + "|".join(known))


def to_json(config: ml_collections.ConfigDict) -> str:
    """The resolved config as sorted, indented JSON."""
    return json.dumps(config.to_dict(), indent=2, sort_keys=True, default=str)


def config_hash(config: ml_collections.ConfigDict | Mapping[str, Any], sections: tuple[str, ...]) -> str:
    """A short stable hash of `sections` of `config`."""
    as_dict = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else dict(config)
    picked = {s: as_dict.get(s) for s in sections}
    return hashlib.sha256(json.dumps(picked, sort_keys=True, default=str).encode()).hexdigest()[:16]


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a.b": value} for every leaf of a nested mapping."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of `flatten`."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def config_differences(old: Mapping[str, Any], new: Mapping[str, Any], sections: tuple[str, ...]) -> list[str]:
    """Keys under `sections` whose values differ, as "key: old -> new" strings."""
    def normal(tree: Mapping[str, Any]) -> dict[str, Any]:  # JSON round trip: tuples → lists, as on disk
        return flatten(json.loads(json.dumps({s: tree.get(s, {}) for s in sections}, default=str)))
    flat_old, flat_new = normal(old), normal(new)
    keys = sorted(set(flat_old) | set(flat_new))
    return [f"{k}: {flat_old.get(k)!r} -> {flat_new.get(k)!r}" for k in keys if flat_old.get(k) != flat_new.get(k)]
