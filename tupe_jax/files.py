"""The one place that writes files whole: atomic JSON / text writes (temporary file + rename) and JSON reads.

Every JSON or text file the project writes as a unit (a run's `config.json`, `results.json`, `sweep.json`, reports,
analysis outputs) goes through `write_json` / `write_text`, so a reader never sees half a file and a crash never
leaves one. Appended streams (`metrics.jsonl`, TensorBoard events) and Orbax checkpoints have their own writers.
This is the layer a storage backend other than the local disk plugs into.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np


def _default(value: Any) -> Any:
    """JSON for NumPy scalars/arrays and paths (anything else is an error, not a silent str())."""
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _finite(value: Any) -> Any:
    """NaN/inf → None, so the file is standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def to_json(obj: Any, indent: int | None = 2, sort_keys: bool = True) -> str:
    """`obj` as standard JSON text (NumPy values converted, NaN/inf as null)."""
    plain = json.loads(json.dumps(obj, default=_default))
    return json.dumps(_finite(plain), indent=indent, sort_keys=sort_keys)


def write_text(path: str | os.PathLike, text: str) -> str:
    """Write `text` to `path` atomically (parent folders created); returns the path."""
    path = str(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2, sort_keys: bool = True) -> str:
    """Write `obj` as JSON (see `to_json`) atomically, with a final newline; returns the path."""
    return write_text(path, to_json(obj, indent=indent, sort_keys=sort_keys) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    """Parse the JSON file at `path` (json.JSONDecodeError / OSError propagate to the caller, who names it)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)
