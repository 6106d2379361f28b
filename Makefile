# The two set-up commands: `make demo` (the main job on the embedded corpus) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m launch demo --workdir=runs/demo

# XLA_FLAGS: the suite's own (tests/xla_flags.py: 8 fake CPU devices, -O0), not one from the caller's shell.
# GLIBC_TUNABLES: huge pages for XLA:CPU's per-call buffers in the pytest processes (tupe_jax/allocator.py's
# `hugepages`); the `python -m launch` processes the tests start choose their own malloc, as they do anywhere.

# One pytest worker per core (pytest-xdist), a test file per worker at a time: most of a test's time is
# single-threaded tracing and compiling, so two workers on two cores take ~0.7x the serial time
# (benchmarks/results_suite_time_avx2.json).
# `make test WORKERS=0` runs in one process.
WORKERS ?= auto
PYTEST := env -u XLA_FLAGS GLIBC_TUNABLES=glibc.malloc.hugetlb=1 $(PY) -m pytest -q -n $(WORKERS) --dist loadfile

test: $(STAMP)
	$(PYTEST) tests

test-fast: $(STAMP)
	$(PYTEST) -m "not slow" tests

clean:
	rm -rf $(VENV) runs/demo
