"""What a source file is known by in cache keys, prepared folders and data-iterator states.

A stamp follows the file's content, not where or when it was written: its path under the source folder, its size
and the sha256 of its bytes. A copy of the same files (a fresh VM, a re-mirrored bucket, a copy that did not keep
times) is the same data, so a run resumes on it; an edited file is new data.

    file_stamps(files, root, lines=False) -> [[relative path, size, sha256(, NEWLINE_ONLY)], ...]
    legacy_file_stamps(files)              -> [[absolute path, size, mtime_ns], ...]   (data format 1)
"""
from __future__ import annotations

import hashlib
import os

from tupe_jax.data import sources

NEWLINE_ONLY = "newline-only"   # the 4th entry of a file `sources.read_lines` reads with other breaks kept in lines
_SHA256: dict[tuple, tuple[str, bool]] = {}   # (realpath, size, mtime, inode) -> (sha256, other breaks), per process


def digest_and_breaks(path) -> tuple[str, bool]:
    """The sha256 of a file's bytes, and whether they hold a `sources.OTHER_BREAKS` character, in one pass."""
    sha, found, tail = hashlib.sha256(), False, b""
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            sha.update(chunk)
            if not found:
                window = tail + chunk      # with the last 2 bytes before: a 3-byte break split between two reads
                found = any(b in window for b in sources.OTHER_BREAKS)   # memchr-fast, unlike a regex
            tail = chunk[-2:]
    return sha.hexdigest(), found


def file_stamps(files, root, lines: bool = False) -> list:
    """Per file: its path relative to the source folder `root` (its name where `root` is a file), its size and the
    sha256 of its bytes; a link is stamped by its target. `lines` (files read by `sources.read_lines`): a file
    holding a character that earlier versions read as a line break gets a fourth entry, `NEWLINE_ONLY`, so what
    was built from the lines cut there (a cache, a prepared folder, an iterator state) is not taken for its
    documents now; every other file keeps the stamp it had."""
    out = []
    for f in files:
        st = os.stat(f)
        memo = (os.path.realpath(f), st.st_size, st.st_mtime_ns, st.st_ino)
        if memo not in _SHA256:            # once per file and process (several readers ask for the same key)
            try:
                _SHA256[memo] = digest_and_breaks(f)
            except OSError as err:
                raise sources.unreadable(f, err) from None
        sha, breaks = _SHA256[memo]
        real = os.path.realpath(f)         # a link is stamped by its target, as before links kept their names
        out.append([os.path.relpath(real, root) if os.path.isdir(root) else os.path.basename(real), st.st_size, sha]
                   + ([NEWLINE_ONLY] if lines and breaks else []))
    return out


def legacy_file_stamps(files) -> list:
    """The stamps of data format 1 (path, size, mtime): only to recognise iterator states saved by that version."""
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
