#!/usr/bin/env bash
# Fetch, on this machine (it reaches PyPI), the wheels that the lent H200 machine lacks, so that a device session
# is one call: the machine has jax, flax, optax, orbax-checkpoint and the rest of what the model imports, but not
# these four (its package list: /work/.library/device/KINDS.md; the GPU scripts import nothing else of ours).
#   bash benchmarks/gpu_wheels.sh      # -> .whl/*.whl (the four) and .whl/opt/*.whl (a flax fallback)
# then, with the device tool: run(command="bash benchmarks/gpu_round2.sh", carry=[".whl"]). `.whl/` is git-ignored.
# Versions: the ones installed in this checkout's .venv (`make test` installs it), so the device runs what CI tests;
# wheels for the machine's Python 3.12 on x86-64 Linux. gpu_device_run.sh installs .whl/opt only if the
# machine's own flax fails the smoke run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 any; do PLATFORMS+=(--platform "$p"); done
fetch() {  # fetch DEST NAME...
  local dest=$1; shift
  local specs=()
  for name in "$@"; do specs+=("$name==$(version "$name")"); done
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$dest" "${specs[@]}"
}
rm -rf .whl
fetch .whl grain ml_collections array_record portpicker
fetch .whl/opt flax
ls -l .whl .whl/opt
