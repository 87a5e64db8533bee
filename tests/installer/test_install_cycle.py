# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Install, status, re-run, dry run, upgrade and uninstall on real vLLM 0.32.0 and 0.33.0 trees,
with patches and overlay files generated against those trees' own sources."""

import json
from pathlib import Path

from installer.errors import ExitCode
from installer.state import STATE_DIR
from tests.helpers import replace_file
from tests.installer.installer_testlib import (
    EAGLE,
    OVERLAY_A,
    OVERLAY_B,
    SPECULATIVE,
    GeneratedProject,
    copy_vllm_tree,
    edited_source,
    record_problems,
    snapshot,
    sources,
)


def status_of(project: GeneratedProject, tree: Path) -> tuple[int, dict]:
    result = project.install(tree, "--status", "--json")
    return result.returncode, json.loads(result.stdout)


def test_install_status_rerun_uninstall(project: GeneratedProject, tree: Path, pristine: Path):
    before = snapshot(tree)

    result = project.install(tree)
    assert result.returncode == ExitCode.OK, result.stderr
    for path in OVERLAY_A:
        assert (tree / path).read_text() == (project.root / "overlay" / path).read_text()
    for target in (SPECULATIVE, EAGLE):
        assert (tree / target).read_bytes() == edited_source((pristine / target).read_bytes(), "a")
    ring = tree / "vllm/v1/spec_decode/dspark_probe/__pycache__"
    assert any(ring.glob("ring.*.pyc")), "written modules are byte-compiled"

    code, status = status_of(project, tree)
    assert code == ExitCode.OK
    assert status["state"] == "installed"
    assert list(project.versions) == [status["vllm_version"]]
    assert {file["path"] for file in status["files"]} == {SPECULATIVE, EAGLE, *OVERLAY_A}
    assert {file["state"] for file in status["files"]} == {"installed"}
    text = project.install(tree, "--status").stdout
    assert f"digest: {status['digest']}" in text.splitlines()

    installed = snapshot(tree)
    rerun = project.install(tree)
    assert rerun.returncode == ExitCode.OK
    assert "already installed" in rerun.stdout and "nothing was written" in rerun.stdout
    assert snapshot(tree) == installed

    dry = project.install(tree, "--dry-run")
    assert dry.returncode == ExitCode.OK and "nothing was changed" in dry.stdout
    assert snapshot(tree) == installed

    result = project.install(tree, "--uninstall")
    assert result.returncode == ExitCode.OK, result.stderr
    assert record_problems(tree) == []
    assert sources(tree) == sources(pristine)
    assert sources(tree) == {
        path: digest for path, digest in before.items() if "__pycache__" not in path
    }
    assert not (tree / "vllm/v1/spec_decode/dspark_probe").exists(), "created dirs are removed"

    code, status = status_of(project, tree)
    assert (code, status["state"]) == (ExitCode.NOT_INSTALLED, "not-installed")
    again = project.install(tree, "--uninstall")
    assert again.returncode == ExitCode.OK and "not installed" in again.stdout


def test_dry_run_lists_changes_and_writes_nothing(project: GeneratedProject, tree: Path):
    before = snapshot(tree)
    result = project.install(tree, "--dry-run")
    assert result.returncode == ExitCode.OK, result.stderr
    assert f"patch         {SPECULATIVE}" in result.stdout
    assert "add           vllm/v1/spec_decode/dspark_probe/nested/slots.py" in result.stdout
    assert snapshot(tree) == before


def test_vllm_path_accepts_the_package_directory(project: GeneratedProject, tree: Path):
    result = project.install(tree / "vllm")
    assert result.returncode == ExitCode.OK, result.stderr
    assert (tree / STATE_DIR / "record.json").is_file()


def test_upgrade_from_an_older_project_revision(
    project: GeneratedProject, tree: Path, pristine: Path, tmp_path: Path
):
    assert project.install(tree).returncode == ExitCode.OK
    newer = GeneratedProject.create(tmp_path / "newer", project.versions)
    newer.write_revision("b", OVERLAY_B, [SPECULATIVE])

    code, status = status_of(newer, tree)
    assert (code, status["state"]) == (ExitCode.PARTIAL, "partial")
    assert "another project revision" in " ".join(status["notes"])

    result = newer.install(tree)
    assert result.returncode == ExitCode.OK, result.stderr
    assert (tree / SPECULATIVE).read_bytes() == edited_source(
        (pristine / SPECULATIVE).read_bytes(), "b"
    )
    assert (tree / EAGLE).read_bytes() == (pristine / EAGLE).read_bytes(), "dropped patch undone"
    assert not (tree / "vllm/v1/spec_decode/dspark_probe/nested").exists()
    assert (tree / "vllm/v1/spec_decode/dspark_probe/proposer.py").is_file()
    code, status = status_of(newer, tree)
    assert (code, status["state"]) == (ExitCode.OK, "installed")

    assert newer.install(tree, "--uninstall").returncode == ExitCode.OK
    assert record_problems(tree) == []
    assert sources(tree) == sources(pristine)


def test_two_nodes_compare_digests(project: GeneratedProject, tree: Path, pristine: Path, tmp_path):
    other = copy_vllm_tree(pristine, tmp_path / "other-node")
    assert project.install(tree).returncode == ExitCode.OK
    assert project.install(other).returncode == ExitCode.OK
    assert status_of(project, tree)[1]["digest"] == status_of(project, other)[1]["digest"]
    ring = other / "vllm/v1/spec_decode/dspark_probe/ring.py"
    replace_file(ring, b"RING = 'tampered'\n")
    code, status = status_of(project, other)
    assert (code, status["state"]) == (ExitCode.DRIFTED, "drifted")
    assert status["digest"] != status_of(project, tree)[1]["digest"]


def test_stacked_patches_of_one_file(version: str, pristine: Path, tree: Path, tmp_path: Path):
    """Two patches of eagle.py apply in order; the record keeps one entry with vLLM's original
    hash, and uninstall restores it."""
    project = GeneratedProject.create(tmp_path / "project", {version: pristine})
    project.write_revision("s", {}, [EAGLE, SPECULATIVE, EAGLE])
    original = (pristine / EAGLE).read_bytes()

    assert project.install(tree).returncode == ExitCode.OK
    assert (tree / EAGLE).read_bytes() == edited_source(edited_source(original, "s"), "s2")
    code, status = status_of(project, tree)
    assert (code, status["state"]) == (ExitCode.OK, "installed")
    assert [file["path"] for file in status["files"]] == [SPECULATIVE, EAGLE]

    assert project.install(tree, "--uninstall").returncode == ExitCode.OK
    assert sources(tree) == sources(pristine)
