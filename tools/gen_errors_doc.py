"""Regenerate docs/errors.md from the catalogue test: `python tools/gen_errors_doc.py`.

Runs tests/test_errors_catalogue.py with TUPE_JAX_ERRORS_DOC pointing at docs/errors.md; the test module writes the
table (case, command, message) from the messages it actually observed, and only when every case ran and passed.
"""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    out = os.path.join(ROOT, "docs", "errors.md")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    env = dict(os.environ, TUPE_JAX_ERRORS_DOC=out)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not end_to_end",
           os.path.join(ROOT, "tests", "test_errors_catalogue.py")]
    code = subprocess.call(cmd, cwd=ROOT, env=env)
    if code == 0:
        print(f"wrote {out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
