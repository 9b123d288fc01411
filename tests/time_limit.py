"""The suite's guard on its own speed: a test outside `-m slow` that takes more than LIMIT_S seconds fails the
run, so that the README's `pytest` stays within minutes as features arrive. A test that needs more is marked
slow, with a comment saying why.

A test is charged its own setup, call and teardown. A fixture that several tests share (module, class or
session scope) is charged to itself, not to the test that happens to build it first, and is held to the same
limit. The hooks run where the tests run (an xdist worker) and pass their shares on in the reports'
user_properties; the verdict is given where the reports are gathered (the controller, or the one process).
"""

from __future__ import annotations

import os
import time

import pytest

LIMIT_S = 90.0
_SHARED_SCOPES = ("session", "package", "module", "class")
_SHARED = "time_limit: shared"  # (name, value) pairs, as junitxml writes user_properties
_SLOW = "time_limit: slow"

_open: list[float] = []  # this worker: per fixture being set up, seconds of shared fixtures built inside it
_built: list[tuple[str, float]] = []  # this worker, this phase: shared fixtures built, each its own seconds
_charged: dict[str, float] = {}  # where reports gather: test or shared fixture -> seconds


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    start = time.perf_counter()
    _open.append(0.0)
    yield
    inside, seconds = _open.pop(), time.perf_counter() - start
    shared = fixturedef.scope in _SHARED_SCOPES
    if shared:  # its own time: less the shared fixtures it asked for, which are charged to themselves
        _built.append((f"{fixturedef.scope} fixture {fixturedef.argname}", seconds - inside))
    if _open:
        _open[-1] += seconds if shared else inside


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.user_properties.extend((f"{_SHARED} {name}", seconds) for name, seconds in _built)
    _built.clear()
    if item.get_closest_marker("slow"):
        report.user_properties.append((_SLOW, True))


def pytest_runtest_logreport(report):
    built = [(name.removeprefix(_SHARED + " "), s) for name, s in report.user_properties if name.startswith(_SHARED)]
    if any(name == _SLOW for name, _ in report.user_properties):
        return  # a drill, and what its setup built
    shared = sum(seconds for _, seconds in built)
    _charged[report.nodeid] = _charged.get(report.nodeid, 0.0) + max(0.0, report.duration - shared)
    for name, seconds in built:
        key = name if name.startswith("session") else f"{report.nodeid.split('::')[0]}: {name}"
        _charged[key] = max(_charged.get(key, 0.0), seconds)


def over_limit() -> list[tuple[str, float]]:
    if os.environ.get("TRAINER_TEST_XLA") == "defaults":
        return []  # tests/test_xla_defaults.py's run at XLA's slower compile, itself a slow test
    return sorted(((n, s) for n, s in _charged.items() if s > LIMIT_S), key=lambda x: -x[1])


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput"):
        return
    late = over_limit()
    if late:
        terminalreporter.section(f"over the {LIMIT_S:.0f}-second limit outside -m slow (tests/time_limit.py)")
        for name, seconds in late:
            terminalreporter.line(f"{seconds:7.1f}s {name}")
        terminalreporter.line("Make each faster (shared fixtures, smaller shapes), or mark it slow with the reason.")


def pytest_sessionfinish(session, exitstatus):
    if not hasattr(session.config, "workerinput") and over_limit() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
