# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The test tiers, marked by folder (pyproject.toml registers them; CONTRIBUTING.md lists them).

- ``unit``: pure logic and vLLM's config objects, the installer, the launcher with fakes; no
  engine, no vLLM subprocess.
  The fast tier: ``pytest -m unit``.
- ``engine``: a real in-process vLLM CPU engine (``tests/engine``, ``tests/engine_v4``, and tests
  elsewhere marked so).
- ``multiproc``: vLLM in other processes (tensor parallel 2, ``vllm serve``, its CLI or config
  checks run in a subprocess), marked per test.
- ``docker``: the Dockerfiles, the image's scripts and the images themselves (``tests/docker``).

A test gets its folder's tier unless it is marked ``engine``, ``multiproc`` or ``docker`` itself;
whatever is none of these is ``unit``.
"""

from pathlib import Path

import pytest

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
        folder = item.path.relative_to(TESTS).parts[0]
        if folder in FOLDER_TIERS and not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(FOLDER_TIERS[folder])
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker("unit")
    file_rank: dict[Path, int] = {}  # a file takes its slowest test's place
    for item in items:
        rank = next(i for i, tier in enumerate(FILE_ORDER) if item.get_closest_marker(tier))
        file_rank[item.path] = min(file_rank.get(item.path, rank), rank)
    items.sort(key=lambda item: file_rank[item.path])  # stable: files stay whole, in order
