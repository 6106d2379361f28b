"""A pytest plugin for benchmarks/suite_profile.py: each test's time, and JAX's compile events inside it.

    python -m pytest -p suite_events ...      (with benchmarks/ on PYTHONPATH and $SUITE_EVENTS_DIR set)

Each pytest process (an xdist worker, or the one process without xdist) writes `<SUITE_EVENTS_DIR>/<pid>.json` at
its end: {"tests": {nodeid: {"s": setup + call + teardown seconds, "events": {event: seconds}}}, "events":
{event: [count, seconds]}}. The events are the durations `jax.monitoring` reports in this process: tracing,
lowering, XLA's compile, the persistent cache's reads (the processes a test starts are not seen; their time is in
the test's). The listener is registered at `pytest_configure`, after the suite's conftest has set JAX's
environment (the cache folder, the flags): importing jax earlier would fix its settings before that.
"""
from __future__ import annotations

import collections
import json
import os

_TESTS: dict = collections.defaultdict(lambda: {"s": 0.0, "events": collections.defaultdict(float)})
_EVENTS: dict = collections.defaultdict(lambda: [0, 0.0])
_CURRENT = {"test": ""}


def _on_event(event: str, duration: float, **_) -> None:
    _EVENTS[event][0] += 1
    _EVENTS[event][1] += duration
    if _CURRENT["test"]:
        _TESTS[_CURRENT["test"]]["events"][event] += duration


def pytest_configure(config) -> None:  # pylint: disable=unused-argument
    """Listen to JAX's duration events from here on."""
    import jax.monitoring  # pylint: disable=import-outside-toplevel
    jax.monitoring.register_event_duration_secs_listener(_on_event)


def pytest_runtest_logstart(nodeid, location) -> None:  # pylint: disable=unused-argument
    _CURRENT["test"] = nodeid


def pytest_runtest_logfinish(nodeid, location) -> None:  # pylint: disable=unused-argument
    _CURRENT["test"] = ""


def pytest_runtest_logreport(report) -> None:
    """Add each phase's duration (setup, call, teardown) to its test."""
    _TESTS[report.nodeid]["s"] += report.duration


def pytest_unconfigure(config) -> None:
    """Write this process's file (nothing when $SUITE_EVENTS_DIR is unset, nor from xdist's controller, which sees
    every worker's reports again but runs no test)."""
    folder = os.environ.get("SUITE_EVENTS_DIR", "")
    controller = getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput")
    if not folder or controller or not (_TESTS or _EVENTS):
        return
    with open(os.path.join(folder, f"{os.getpid()}.json"), "w", encoding="utf-8") as f:
        json.dump({"tests": _TESTS, "events": _EVENTS}, f)
