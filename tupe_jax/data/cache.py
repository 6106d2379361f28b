"""The data cache and the TFDS builder every local source is prepared with (array_record, no TensorFlow).

    cache_dir(config)     `data.cache_dir`, else $TUPE_JAX_CACHE, else ~/.cache/tupe_jax (prepared datasets under
                          tfds/, token streams under streams/, learned vocabularies under tokenizers/); created
                          on first use
    local_builder(...)    a `tfds.core.GeneratorBasedBuilder` prepared once (under a file lock) in the cache
    file_lock(path)       an exclusive inter-process lock; digest(obj) a short stable hash
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from tupe_jax import files
from tupe_jax.errors import UserError


def cache_path(config) -> Path:
    """`data.cache_dir`, else $TUPE_JAX_CACHE, else ~/.cache/tupe_jax (not made: `cache_dir`)."""
    return Path(config.data.get("cache_dir", "") or os.environ.get("TUPE_JAX_CACHE", "") or "~/.cache/tupe_jax"
                ).expanduser()


def cache_dir(config) -> Path:
    """`cache_path`, made when missing."""
    path = cache_path(config)
    where = "--config.data.cache_dir" if config.data.get("cache_dir", "") else "TUPE_JAX_CACHE / ~/.cache/tupe_jax"
    if path.exists() and not path.is_dir():
        raise UserError(f"the data cache {path} is a file, not a folder", where, "give a folder for the data cache")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create the data cache {path} ({err.strerror})", where,
                        "give a writable folder for the data cache") from None
    return path


def local_input(config, path: str, where: str) -> str:
    """`path` itself when local; for a bucket path (gs://...), a copy mirrored once into `<cache>/inputs/` (sources
    such as text files and GLUE TSVs are read locally; the copy follows the bucket: `files.mirror`)."""
    if "://" not in str(path):
        return path
    files.check_bucket(str(path), where)
    root = cache_dir(config) / "inputs" / hashlib.sha256(str(path).encode()).hexdigest()[:16]
    try:
        with file_lock(root.parent / (root.name + ".lock")):
            return files.mirror(str(path), str(root))
    except FileNotFoundError:
        raise UserError(f"nothing at {path}", where, "point it at an existing bucket file or folder") from None


@contextlib.contextmanager
def file_lock(path: Path):
    """Exclusive inter-process lock (several processes of one host may prepare the same dataset)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------- builders

def _tfds():
    import tensorflow_datasets as tfds
    return tfds


def _make_builder_class():
    tfds = _tfds()

    class LocalBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        """A builder whose examples come from a Python callable `make(split) -> iterable of dicts`."""
        VERSION = tfds.core.Version("1.0.0")
        RELEASE_NOTES = {"1.0.0": "Initial version."}

        # tfds' default code_path probes `importlib_resources` (a backport only installed for Python < 3.9)
        # for builders defined inside a package; this builder has no code-side resources, so point at this file.
        @tfds.core.utils.classproperty
        @classmethod
        def code_path(cls):
            from etils import epath
            return epath.Path(__file__)

        def __init__(self, *, kind: str, spec: dict, splits: list[str], features,
                     make: Callable[[str], Iterator[dict]], data_dir: Path):
            self.name = f"tupe_{kind}"
            self._splits, self._features, self._make = list(splits), features, make
            config = tfds.core.BuilderConfig(name="c" + digest(spec), description=json.dumps(spec, sort_keys=True))
            super().__init__(data_dir=str(data_dir), config=config, file_format="array_record")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=self._features, disable_shuffling=True,
                                         description=f"tupe_jax local dataset {self.name}")

        def _split_generators(self, dl_manager):
            return {s: self._generate_examples(s) for s in self._splits}

        def _generate_examples(self, split):
            for i, ex in enumerate(self._make(split)):
                yield i, ex

    return LocalBuilder


_BUILDER_CLASS = None


def local_builder(config, kind: str, spec: dict, splits: list[str], features, make):
    """Build (once, under a lock) and return a prepared LocalBuilder."""
    global _BUILDER_CLASS
    if _BUILDER_CLASS is None:
        _BUILDER_CLASS = _make_builder_class()
    root = cache_dir(config) / "tfds"
    with _quiet_absl(), _scratch_tempdir(root):
        return _prepared(config, kind, spec, splits, features, make, root)


@contextlib.contextmanager
def _scratch_tempdir(root: Path):
    """tfds makes a temporary folder per builder construction (to look for dataset info in a bucket we never
    use) and leaves it in $TMPDIR: point the temp folder at a scratch folder under the cache and remove it."""
    root.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".scratch-", dir=root)
    old = tempfile.tempdir
    tempfile.tempdir = scratch
    try:
        yield
    finally:
        tempfile.tempdir = old
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _quiet_absl():
    """tfds warns 'Using custom data configuration' for every construction of a config-keyed builder."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _prepared(config, kind, spec, splits, features, make, root):
    tfds = _tfds()

    def build():
        return _BUILDER_CLASS(kind=kind, spec=spec, splits=splits, features=features, make=make, data_dir=root)

    builder = build()
    if not builder.is_prepared():
        with file_lock(root / "locks" / f"{builder.name}-{builder.builder_config.name}.lock"):
            builder = build()
            if not builder.is_prepared():
                from tensorflow_datasets.core.utils import tqdm_utils
                was = tqdm_utils._active  # pylint: disable=protected-access
                tfds.display_progress_bar(False)
                print(f"data: preparing {kind} ({', '.join(splits)}) in {root}, once", flush=True)
                try:   # tfds prints "Downloading and preparing ..." although nothing is downloaded: swallowed
                    with contextlib.redirect_stdout(io.StringIO()):
                        builder.download_and_prepare(
                            download_config=tfds.download.DownloadConfig(try_download_gcs=False))
                finally:
                    tfds.display_progress_bar(was)
    # made now that the dataset is complete: a builder reads the dataset's info when it is made, so one made before
    # another process (sharing this cache) finished preparing it would report prepared but hold no splits
    return build()
