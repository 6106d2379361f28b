"""The path layer: every run-folder and data path goes through here, local or in a bucket (`gs://...`).

Local paths use `os`; a path with a scheme (`gs://bucket/run`) goes through `etils.epath` (gcsfs underneath, the
library Orbax uses too; checkpoint arrays go through tensorstore, which reads gs:// paths itself), whole-file reads
through gcsfs's one-request get. Whole files are written atomically: locally a temporary file + rename; in a bucket
an object upload is atomic by nature (an object appears whole or not at all). Appending (`append_text`) is native
locally; in a bucket, objects are immutable, so the object is rewritten whole (`metrics.MetricsWriter` buffers rows
and flushes them at intervals and at every checkpoint, so a rewrite happens seldom).

Every JSON or text file the project writes as a unit (a run's `config.json`, `results.json`, `sweep.json`, reports,
analysis outputs) goes through `write_json` / `write_text`, so a reader never sees half a file.

gcsfs's experimental zonal/HNS bucket probe (a gRPC call that hangs where only the JSON API is reachable, e.g. an
emulator) is off unless GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT says otherwise.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import socket
import urllib.parse
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from tupe_jax.errors import UserError, require

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
# gcsfs logs each retry of a failing request with its traceback; the failure reaches the caller, who reports it
# in one line, so those logs would only bury that line (a storage outage printed screens of them before it)
logging.getLogger("gcsfs").setLevel(logging.CRITICAL)


def is_remote(path: Any) -> bool:
    """True for a path with a scheme (gs://, ...)."""
    return "://" in str(path)


def _epath(path: Any):
    from etils import epath  # pylint: disable=import-outside-toplevel
    return epath.Path(str(path))


def stat_bucket(url: str) -> dict:
    """The bucket's metadata; FileNotFoundError if it does not exist, the transport's error if unreachable."""
    if str(url).startswith("gs://"):   # a refused connection fails at once here, not after gcsfs's ~60 s of retries
        endpoint = urllib.parse.urlsplit(os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com")
        port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
        try:
            socket.create_connection((endpoint.hostname, port), timeout=10).close()
        except OSError as err:
            raise ConnectionError(f"{endpoint.hostname}:{port}: {err.strerror or err}") from None
    import fsspec  # pylint: disable=import-outside-toplevel
    fs, path = fsspec.core.url_to_fs(url)
    return fs.info(path)


BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")   # GCS: 3-63 (dotted: 222) lowercase chars


def check_bucket(path: str, where: str) -> None:
    """Before a command reads or writes the bucket path `path`: it is `gs://<bucket>/<folder>` with a valid bucket
    name, no empty part (`gs://b//x` is another object name on GCS than `gs://b/x`) and no glob, and the bucket
    exists and its storage answers; a one-line UserError naming `where` otherwise."""
    text = str(path)
    scheme, _, rest = text.partition("://")
    bucket, _, folder = rest.partition("/")
    require(scheme == "gs", f"{text} is not a gs:// path", where, "give a local path or gs://BUCKET/FOLDER")
    require(bool(BUCKET_NAME.match(bucket)) and ".." not in bucket, f"{text}: {bucket!r} is not a bucket name",
            where, "bucket names are 3-63 lowercase letters, digits, '-', '_' or '.', starting and ending with a "
            "letter or digit")
    require("//" not in folder.rstrip("/") and not folder.startswith("/"), f"{text} has an empty folder name (//)",
            where, "write the path with single slashes")
    require(not any(c in folder for c in "*?["), f"{text} is a pattern; bucket paths name one file or folder",
            where, "give the folder (every text file in it is read) or one object")
    try:
        stat_bucket(f"gs://{bucket}")
    except FileNotFoundError:
        raise UserError(f"bucket gs://{bucket} does not exist (or this account cannot list it)", where,
                        "create the bucket or fix the name / permissions") from None
    except Exception as err:  # pylint: disable=broad-except  # any transport failure: one line, before compute
        raise UserError(f"cannot reach the storage of gs://{bucket} ({type(err).__name__}: "
                        f"{(str(err).splitlines() or [''])[0][:160]})", where,
                        "check the network / STORAGE_EMULATOR_HOST and the credentials") from None


def join(base: Any, *parts: str) -> str:
    """`os.path.join` for local paths, "/"-joined for bucket paths."""
    if is_remote(base):
        return "/".join([str(base).rstrip("/"), *[p.strip("/") for p in parts]])
    return os.path.join(str(base), *parts)


def absolute(path: Any) -> str:
    """An absolute local path (Orbax wants them), or the bucket path as it is."""
    return str(path) if is_remote(path) else os.path.abspath(str(path))


def exists(path: Any) -> bool:
    return _epath(path).exists() if is_remote(path) else os.path.exists(path)


def isdir(path: Any) -> bool:
    return _epath(path).is_dir() if is_remote(path) else os.path.isdir(path)


def isfile(path: Any) -> bool:
    return _epath(path).is_file() if is_remote(path) else os.path.isfile(path)


def listdir(path: Any) -> list[str]:
    return sorted(p.name for p in _epath(path).iterdir()) if is_remote(path) else os.listdir(path)


def walk(path: Any) -> Iterator[tuple[str, list[str], list[str]]]:
    """`os.walk` of a local or bucket folder, top down: (a folder, its folders' names, its files' names)."""
    if not is_remote(path):
        return os.walk(path)
    import fsspec  # pylint: disable=import-outside-toplevel
    fs, root = fsspec.core.url_to_fs(str(path))
    found = fs.walk(root, refresh=True)   # not listings gcsfs kept: objects others wrote since would be missed
    return ((fs.unstrip_protocol(folder), dirs, names) for folder, dirs, names in found)


def glob(path: Any, pattern: str) -> list[str]:
    """The paths under the folder `path` that match `pattern` (e.g. "*/config.json"), sorted."""
    return sorted(str(p) for p in _epath(path).glob(pattern))


def makedirs(path: Any) -> None:
    if is_remote(path):
        _epath(path).mkdir(parents=True, exist_ok=True)
    else:
        os.makedirs(path, exist_ok=True)


def remove(path: Any) -> None:
    if is_remote(path):
        _epath(path).unlink(missing_ok=True)
    elif os.path.lexists(path):
        os.remove(path)


def rmtree(path: Any) -> None:
    if is_remote(path):
        _epath(path).rmtree(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def rename(src: Any, dst: Any) -> None:
    if is_remote(src):
        _epath(src).rename(_epath(dst))
    else:
        os.rename(src, dst)


def read_text(path: Any) -> str:
    """The file's text; a bucket object's in one request, so one whole generation of it even while another process
    rewrites it (a file object asks for the size, then for that many bytes of whatever generation is current)."""
    if is_remote(path):
        import fsspec  # pylint: disable=import-outside-toplevel
        fs, name = fsspec.core.url_to_fs(str(path))
        try:
            return fs.cat_file(name).decode("utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(str(path)) from None
    with open(path, encoding="utf-8") as f:
        return f.read()


def upload(local: Any, path: Any) -> None:
    """Copy the local file `local` to `path` (a bucket object or a local path)."""
    if is_remote(path):
        _epath(path).write_bytes(Path(local).read_bytes())
    else:
        shutil.copyfile(local, path)


def upload_tree(local_dir: Any, path: Any) -> None:
    """Copy every file under the local folder `local_dir` to the same relative path under `path`."""
    for root, _, names in os.walk(local_dir):
        for name in names:
            target = join(path, *os.path.relpath(os.path.join(root, name), local_dir).split(os.sep))
            if not is_remote(target):
                os.makedirs(os.path.dirname(target), exist_ok=True)
            upload(os.path.join(root, name), target)


MIRRORED = ".mirror.json"   # in a mirror's folder: {local path: the object version it holds}


def mirror(url: str, local_root: str) -> str:
    """A local copy of the bucket file or folder `url` under `local_root`, made to follow the bucket: an object is
    downloaded again when its version (generation / hash) differs from the copy's, and a file whose object is gone
    from the bucket is removed (a second call with nothing changed costs one listing); returns the local path
    standing for `url`."""
    import fsspec  # pylint: disable=import-outside-toplevel
    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    found = fs.find(root, detail=True)
    if not found:
        raise FileNotFoundError(url)
    single = list(found) == [root]
    target = os.path.join(local_root, os.path.basename(root)) if single else local_root
    record = os.path.join(local_root, MIRRORED)
    try:
        held = json.loads(read_text(record))
    except (OSError, ValueError):
        held = {}
    now = {}
    for remote, info in found.items():
        local = target if single else os.path.join(local_root, remote[len(root):].lstrip("/"))
        now[local] = "/".join(str(info.get(k, "")) for k in ("generation", "md5Hash", "crc32c", "size"))  # its version
        if os.path.isfile(local) and held.get(local) == now[local]:
            continue
        os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
        fs.get_file(remote, local + ".part")
        os.replace(local + ".part", local)
    for local in set(held) - set(now):   # deleted from the bucket: not in the copy either
        if os.path.isfile(local):
            os.remove(local)
    os.makedirs(local_root, exist_ok=True)
    write_text(record, json.dumps(now, sort_keys=True))
    return target


def append_text(path: Any, text: str) -> None:
    """Append `text` (locally an append; in a bucket a rewrite of the whole object)."""
    if is_remote(path):
        old = read_text(path) if exists(path) else ""
        _epath(path).write_text(old + text, encoding="utf-8")
    else:
        with open(path, "a", encoding="utf-8") as f:
            f.write(text)


# ------------------------------------------------- bucket objects written only if they are as a reader last saw them
# A bucket lease (workdir/lock.py) needs GCS's generation preconditions. gcsfs offers only "create if absent", so
# these go through google-cloud-storage (a dependency of gcsfs), which finds the endpoint and credentials as gcsfs
# does (STORAGE_EMULATOR_HOST, application default credentials). Every object generation is immutable, so a read
# returns one whole generation and its number; a write or delete given that number happens only if nobody wrote
# the object since, and otherwise raises FileExistsError. Generation 0 means "no object".
_STORAGE_CLIENT = None   # google-cloud-storage's client, made at the first use


def _blob(path: Any):
    from google.cloud import storage  # pylint: disable=import-outside-toplevel
    if not str(path).startswith("gs://"):
        raise ValueError(f"{path}: generation-matched objects need a gs:// path")
    bucket, _, name = str(path)[len("gs://"):].partition("/")
    global _STORAGE_CLIENT  # pylint: disable=global-statement
    if _STORAGE_CLIENT is None:
        _STORAGE_CLIENT = storage.Client()
    return _STORAGE_CLIENT.bucket(bucket).blob(name)


def read_object(path: Any) -> tuple[str, int]:
    """The text of the bucket object `path` and its generation; ("", 0) if there is none."""
    from google.api_core import exceptions  # pylint: disable=import-outside-toplevel
    blob = _blob(path)
    try:
        data = blob.download_as_bytes()
    except exceptions.NotFound:
        return "", 0
    return data.decode("utf-8", errors="replace"), int(blob.generation)


def write_object(path: Any, text: str, generation: int) -> int:
    """Write `text` to the bucket object `path` if it is still at `generation` (0: if there is no object); the new
    generation. FileExistsError if another writer got there first: of two writers that read the same generation,
    exactly one wins."""
    from google.api_core import exceptions  # pylint: disable=import-outside-toplevel
    blob = _blob(path)
    try:
        blob.upload_from_string(text.encode("utf-8"), content_type="application/json",
                                if_generation_match=int(generation))
    except exceptions.PreconditionFailed:
        raise FileExistsError(f"{path} changed since generation {generation}") from None
    return int(blob.generation)


def delete_object(path: Any, generation: int) -> bool:
    """Delete the bucket object `path` if it is still at `generation`; False if it changed or is gone."""
    from google.api_core import exceptions  # pylint: disable=import-outside-toplevel
    try:
        _blob(path).delete(if_generation_match=int(generation))
    except (exceptions.PreconditionFailed, exceptions.NotFound):
        return False
    return True


def _default(value: Any) -> Any:
    """JSON for NumPy scalars/arrays and paths (anything else is an error, not a silent str())."""
    for kind, convert in ((np.integer, int), (np.floating, float), (np.ndarray, np.ndarray.tolist), (Path, str)):
        if isinstance(value, kind):
            return convert(value)
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
    if is_remote(path):
        _epath(path).write_text(text, encoding="utf-8")
        return path
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:   # a full disk, an unencodable character: the earlier file stays, and no temporary one
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2, sort_keys: bool = True) -> str:
    """Write `obj` as JSON (see `to_json`) atomically, with a final newline; returns the path."""
    return write_text(path, to_json(obj, indent=indent, sort_keys=sort_keys) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    """Parse the JSON file at `path` (json.JSONDecodeError / OSError propagate to the caller, who names it)."""
    return json.loads(read_text(path))
