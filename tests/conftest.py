# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The test tiers, marked by folder (pyproject.toml registers them; CONTRIBUTING.md lists them).

- ``unit``: pure logic and vLLM's config objects, the installer, the launcher with fakes; no
  engine, no vLLM subprocess (both enforced below), within a time budget.
  The fast tier: ``pytest -m unit``.
- ``engine``: a real in-process vLLM CPU engine (``tests/engine``, ``tests/engine_v4``, and tests
  elsewhere marked so).
- ``multiproc``: vLLM in other processes (tensor parallel 2, ``vllm serve``, its CLI or config
  checks run in a subprocess), or the installer killed at every step; marked per test.
- ``docker``: the Dockerfiles, the image's scripts and the images themselves (``tests/docker``).

A test gets its folder's tier unless it is marked ``engine``, ``multiproc`` or ``docker`` itself;
whatever is none of these is ``unit``.
"""

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.tier_guard import engine_guard

TESTS = Path(__file__).resolve().parent
FOLDER_TIERS = {"engine": "engine", "engine_v4": "engine", "docker": "docker"}
TIERS = ("engine", "multiproc", "docker")
# Files run slowest tier first: xdist hands out whole files in collection order (``--dist
# loadfile --no-loadscope-reorder``, the Makefile's; by default it puts files with the most tests
# first), so an image build or a two-rank serve started last would run alone at the end while
# the other worker idles; the many short unit files fill the end instead.
FILE_ORDER = ("docker", "multiproc", "engine", "unit")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = item.path.relative_to(TESTS).parts[0] if item.path.is_relative_to(TESTS) else ""
        if folder in FOLDER_TIERS and not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(FOLDER_TIERS[folder])
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker("unit")
    file_rank: dict[Path, int] = {}  # a file takes its slowest test's place
    for item in items:
        rank = next(i for i, tier in enumerate(FILE_ORDER) if item.get_closest_marker(tier))
        file_rank[item.path] = min(file_rank.get(item.path, rank), rank)
    items.sort(key=lambda item: file_rank[item.path])  # stable: files stay whole, in order


# The unit tier's rules: no vLLM engine in the test's process or any child it starts
# (tests/tier_guard/engine_guard.py), enforced; a budget for its summed setup and call time.
UNIT_BUDGET_S = 200.0
"""Summed over workers; `make test-fast` runs the tier on two (wall time about half of it)."""
_unit_seconds = [0.0]  # in the process that gets every report: xdist's controller, or the only one
_RECORD = pytest.StashKey[str]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if item.get_closest_marker("unit") is None:
        return (yield)
    engine_guard.install()
    fd, record = tempfile.mkstemp(prefix="dspark-unit-tier-", suffix=".log")
    os.close(fd)
    item.stash[_RECORD] = record
    popen_init = subprocess.Popen.__init__

    def guarded_popen_init(self, args, *rest, env=None, **kwargs):
        env = engine_guard.guard_child_env(dict(os.environ if env is None else env), record)
        popen_init(self, args, *rest, env=env, **kwargs)

    os.environ[engine_guard.RECORD_ENV] = record
    subprocess.Popen.__init__ = guarded_popen_init  # type: ignore[method-assign]
    try:
        return (yield)
    finally:
        subprocess.Popen.__init__ = popen_init  # type: ignore[method-assign]
        os.environ.pop(engine_guard.RECORD_ENV, None)
        Path(record).unlink(missing_ok=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A phase of a unit-tier test that started an engine fails, naming the engine."""
    report = yield
    record = item.stash.get(_RECORD, None)
    started = Path(record).read_text(encoding="utf-8") if record else ""
    if started and report.outcome != "failed":
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid}: a unit-tier test started a vLLM engine or a vLLM subprocess; mark "
            f"it `engine` or `multiproc` (CONTRIBUTING.md, Tests):\n{started}"
        )
    if started:
        Path(record).write_text("")
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "unit" in report.keywords and report.when in ("setup", "call"):
        _unit_seconds[0] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    """The tier's time against its budget, printed, not enforced: a timed assertion would fail
    on a slower host (an AVX2-only EPYC sums 316 s) or beside the engine tests of the other
    worker, where the load, not the tier, decides the sum."""
    if _unit_seconds[0]:
        over = "; over budget" if _unit_seconds[0] > UNIT_BUDGET_S else ""
        terminalreporter.write_line(
            f"unit tier: {_unit_seconds[0]:.0f} s of setup and call time "
            f"(budget {UNIT_BUDGET_S:.0f} s{over})"
        )
