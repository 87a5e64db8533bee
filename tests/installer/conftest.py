# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Fixtures: pristine real vLLM trees (0.32.0 from its environment, 0.33.0 from its wheel) and
per-test copies of them, plus throwaway projects with generated patches and overlay files."""

from pathlib import Path

import pytest
from packaging.version import Version

from tests.installer.installer_testlib import (
    CACHE_033,
    EAGLE,
    OVERLAY_A,
    REPO,
    SETUP_HINT,
    SPECULATIVE,
    VLLM_032,
    GeneratedProject,
    copy_vllm_tree,
    environment_tree,
    record_problems,
    run_installer,
)

PRISTINE_FIXTURES = {"0.32.0": "pristine_032", "0.33.0": "pristine_033"}


@pytest.fixture(scope="session")
def pristine_032(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of .venv-vllm-0.32.0's vLLM with any DSpark install undone and proven identical to
    the wheel's RECORD (the setup command installs the shipped manifest)."""
    if not (VLLM_032 / "vllm" / "__init__.py").is_file():
        pytest.fail(f"{VLLM_032} has no vLLM 0.32.0; {SETUP_HINT}")
    destination = tmp_path_factory.mktemp("vllm-0.32.0") / "site"
    root = copy_vllm_tree(VLLM_032, destination, hardlink=False)
    result = run_installer(REPO, "--vllm-path", str(root), "--uninstall")
    assert result.returncode == 0, result.stderr
    assert record_problems(root) == []
    return root


@pytest.fixture(scope="session")
def pristine_033() -> Path:
    if not (CACHE_033 / "vllm" / "__init__.py").is_file():
        pytest.skip(f"{CACHE_033} is missing; {SETUP_HINT} to fetch the vLLM 0.33.0 sources")
    assert record_problems(CACHE_033) == []
    return CACHE_033


@pytest.fixture(scope="session")
def pristine_running(request: pytest.FixtureRequest) -> Path:
    """The pristine tree of the vLLM version that runs the tests."""
    version = Version(environment_tree().version).public
    return request.getfixturevalue(PRISTINE_FIXTURES[version])


@pytest.fixture(params=sorted(PRISTINE_FIXTURES))
def version(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def pristine(version: str, request: pytest.FixtureRequest) -> Path:
    """The pristine tree of `version` (session-wide: never write into it)."""
    return request.getfixturevalue(PRISTINE_FIXTURES[version])


@pytest.fixture
def tree(pristine: Path, tmp_path: Path) -> Path:
    """A private copy of the pristine tree that the test may install into."""
    return copy_vllm_tree(pristine, tmp_path / "site")


@pytest.fixture(scope="session")
def projects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, GeneratedProject]:
    """One generated project per version, shared by the tests that do not modify it."""
    return {}


@pytest.fixture
def project(
    version: str, pristine: Path, projects: dict[str, GeneratedProject], tmp_path_factory
) -> GeneratedProject:
    """A project whose manifest patches two real vLLM files and adds three overlay files.
    Shared across tests: a test that changes the project must build its own."""
    if version not in projects:
        generated = GeneratedProject.create(tmp_path_factory.mktemp("project"), {version: pristine})
        generated.write_revision("a", OVERLAY_A, [SPECULATIVE, EAGLE])
        projects[version] = generated
    return projects[version]
