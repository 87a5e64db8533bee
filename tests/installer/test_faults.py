# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Crash safety: kill the installer at every durable step of install, uninstall, upgrade and
repair (DSPARK_INSTALL_KILL_AT, an abrupt os._exit like SIGKILL), then show that the next run of
any mode repairs the tree to exactly its state before or after; and that a write failure in the
middle of a commit rolls everything back."""

import json
from pathlib import Path

import pytest

from installer.errors import ExitCode
from installer.faults import KILL_AT_ENV, KILLED_EXIT
from installer.state import JOURNAL, RECORD
from tests.installer.installer_testlib import (
    EAGLE,
    OVERLAY_B,
    SPECULATIVE,
    TOUCHED,
    GeneratedProject,
    sources,
    unwritable,
)

# The machinery is version-independent; test_install_cycle covers both versions.
pytestmark = pytest.mark.parametrize("version", ["0.32.0"])
REPAIR_MODES = (("--status", "--json"), ("--uninstall",), ())


def kill_at(project: GeneratedProject, tree: Path, step: int, *args: str):
    return project.install(tree, *args, env={KILL_AT_ENV: str(step)})


def killed_or_finished(result, step: int) -> bool:
    """True if the run was killed at `step`; False if it finished first (fewer steps)."""
    if result.returncode == KILLED_EXIT:
        assert f"killed at step {step} " in result.stderr
        return True
    assert result.returncode == ExitCode.OK, result.stderr
    return False


def touched(tree: Path) -> dict[str, str]:
    """Sources of the directories the generated project writes to: cheap enough to check after
    every kill. Each test also compares the whole tree once at its end."""
    return sources(tree, TOUCHED)


@pytest.mark.multiproc  # the installer killed in a subprocess at each step
def test_kill_during_install_then_any_mode_repairs(project: GeneratedProject, tree: Path):
    pristine_tree = sources(tree)
    before = touched(tree)
    assert project.install(tree).returncode == ExitCode.OK
    after = touched(tree)
    assert project.install(tree, "--uninstall").returncode == ExitCode.OK

    step = 0
    while killed_or_finished(kill_at(project, tree, step + 1), step + 1):
        step += 1
        interrupted = (tree / JOURNAL).exists()
        mode = REPAIR_MODES[step % len(REPAIR_MODES)]
        repair = project.install(tree, *mode)
        assert "Traceback" not in repair.stderr
        if interrupted:
            assert "repaired an interrupted install" in repair.stderr
        if mode == ("--status", "--json"):
            state = json.loads(repair.stdout)["state"]
            # Before the journal exists nothing outside the state directory was touched; after
            # it is removed (the commit point) the install is complete.
            committed = not interrupted and (tree / RECORD).exists()
            assert state == ("installed" if committed else "not-installed"), step
            assert touched(tree) == (after if committed else before), step
        elif mode == ("--uninstall",):
            assert repair.returncode == ExitCode.OK, repair.stderr
            assert touched(tree) == before, step
        else:
            assert repair.returncode == ExitCode.OK, repair.stderr
            assert touched(tree) == after, step
        if (tree / RECORD).exists():
            assert project.install(tree, "--uninstall").returncode == ExitCode.OK
    assert step >= 20, f"only {step} kill points: the test no longer covers the commit"
    assert touched(tree) == after, "the last run finished the install"
    assert project.install(tree, "--uninstall").returncode == ExitCode.OK
    assert sources(tree) == pristine_tree


@pytest.mark.multiproc  # the installer killed in a subprocess at each step
def test_kill_during_uninstall_then_next_run_repairs(project: GeneratedProject, tree: Path):
    pristine_tree = sources(tree)
    before = touched(tree)
    assert project.install(tree).returncode == ExitCode.OK
    installed = touched(tree)

    step = 0
    while killed_or_finished(kill_at(project, tree, step + 1, "--uninstall"), step + 1):
        step += 1
        interrupted = (tree / JOURNAL).exists()
        status = project.install(tree, "--status")
        state = "installed" if interrupted or (tree / RECORD).exists() else "not-installed"
        assert f"state: {state}" in status.stdout, (step, status.stdout)
        assert touched(tree) == (installed if state == "installed" else before), step
        if state == "not-installed":
            assert project.install(tree).returncode == ExitCode.OK
    assert step >= 20, f"only {step} kill points"
    assert sources(tree) == pristine_tree


@pytest.mark.multiproc  # the installer killed in a subprocess at each step
def test_kill_during_upgrade_restores_the_older_install(
    project: GeneratedProject, tree: Path, tmp_path: Path
):
    assert project.install(tree).returncode == ExitCode.OK
    older = touched(tree)
    newer = GeneratedProject.create(tmp_path / "newer", project.versions)
    newer.write_revision("b", OVERLAY_B, [SPECULATIVE])

    mid_commit = 0
    for step in range(2, 100, 3):
        if not killed_or_finished(kill_at(newer, tree, step), step):
            break
        interrupted = (tree / JOURNAL).exists()
        mid_commit += interrupted
        if not interrupted and newer.install(tree, "--status").returncode == ExitCode.OK:
            continue  # killed after the commit point: the upgrade is complete
        status = project.install(tree, "--status")
        assert status.returncode == ExitCode.OK, "the older revision is intact again"
        assert touched(tree) == older, step
    assert mid_commit >= 5, f"only {mid_commit} kills landed mid-commit"
    assert newer.install(tree, "--status").returncode == ExitCode.OK, "the last run upgraded"


@pytest.mark.multiproc  # the installer killed in a subprocess at each step
def test_kill_during_repair_then_repair_again(project: GeneratedProject, tree: Path):
    before = sources(tree)
    assert kill_at(project, tree, 16).returncode == KILLED_EXIT
    assert (tree / JOURNAL).exists()
    step = 1
    while (repair := kill_at(project, tree, step, "--status")).returncode == KILLED_EXIT:
        assert f"killed at step {step} " in repair.stderr
        assert (tree / JOURNAL).exists(), "the journal stays until the repair completes"
        step += 1
    assert step > 5, "the repair was killed at several of its steps"
    assert repair.returncode == ExitCode.NOT_INSTALLED, repair.stderr
    assert "repaired an interrupted install" in repair.stderr
    assert sources(tree) == before


def test_unwritable_directory_mid_commit_rolls_everything_back(
    project: GeneratedProject, tree: Path
):
    """speculative.py (vllm/config/) is committed before eagle.py (vllm/v1/spec_decode/), whose
    directory refuses the temp file: the first file is restored and the overlay never lands."""
    before = sources(tree)
    with unwritable(tree / "vllm/v1/spec_decode"):
        result = project.install(tree)
    assert result.returncode == ExitCode.FAILED, result.stderr
    assert "install failed" in result.stderr and EAGLE in result.stderr
    assert "Every change was rolled back and verified" in result.stderr
    assert "Traceback" not in result.stderr
    assert sources(tree) == before
    assert not (tree / JOURNAL).exists()
    assert project.install(tree).returncode == ExitCode.OK, "a later run installs cleanly"


def test_repair_that_cannot_write_keeps_the_journal(project: GeneratedProject, tree: Path):
    """A kill mid-commit, then a tree that refuses writes: install exits 4 (manual repair) and
    status reports "partial" with the reason; once writable, the next run repairs."""
    before = sources(tree)
    assert kill_at(project, tree, 16).returncode == KILLED_EXIT
    with unwritable(tree / "vllm/config"):
        result = project.install(tree)
        status = project.install(tree, "--status", "--json")
    assert result.returncode == ExitCode.ROLLBACK_FAILED, result.stderr
    assert "rolling back the install failed" in result.stderr
    assert "journal" in result.stderr and "is kept" in result.stderr
    assert "Traceback" not in result.stderr
    assert status.returncode == ExitCode.PARTIAL
    report = json.loads(status.stdout)
    assert report["state"] == "partial"
    assert any("rolling back the install failed" in note for note in report["notes"])
    assert (tree / JOURNAL).exists()

    status = project.install(tree, "--status")
    assert status.returncode == ExitCode.NOT_INSTALLED, status.stdout
    assert sources(tree) == before
