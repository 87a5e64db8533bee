# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Every bad input is refused with a clear message, no traceback, its documented exit code, and
a tree that is byte-identical afterwards (bytecode caches included: nothing is written)."""

import fcntl
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from installer.errors import ExitCode
from installer.hashing import sha256_hex
from installer.state import JOURNAL
from installer.vllm_tree import V1_RUNNER
from tests.helpers import replace_file
from tests.installer.installer_testlib import (
    EAGLE,
    OVERLAY_A,
    SPECULATIVE,
    GeneratedProject,
    snapshot,
    sources,
    unwritable,
)

# The machinery is version-independent; test_install_cycle covers both versions.
pytestmark = pytest.mark.parametrize("version", ["0.32.0"])


def assert_refused(result, code: ExitCode, *phrases: str) -> None:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("install.py: error: ")
    for phrase in phrases:
        assert phrase in result.stderr, (phrase, result.stderr)


def set_version(tree: Path, name: str, version: str) -> None:
    """Rewrite the dist-info and vllm/_version.py as another build would have them."""
    (metadata,) = tree.glob("vllm*.dist-info/METADATA")
    text = re.sub(r"(?m)^Version: .*$", f"Version: {version}", metadata.read_text())
    replace_file(metadata, re.sub(r"(?m)^Name: .*$", f"Name: {name}", text).encode())
    version_file = tree / "vllm" / "_version.py"
    text = re.sub(r"'\d+\.\d+\.\d+'", f"'{version}'", version_file.read_text())
    replace_file(version_file, text.encode())


def test_path_that_is_not_a_vllm_tree(project: GeneratedProject, tmp_path: Path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for path in (empty, tmp_path / "missing", project.root / "install.py"):
        result = project.install(path)
        assert_refused(result, ExitCode.BAD_TARGET, "is not a vLLM tree", "--vllm-path must be")
    assert list(empty.iterdir()) == []


@pytest.mark.parametrize(
    ("version_set", "without_v1", "phrases"),
    [
        ("0.31.0", False, ("vLLM 0.31.0 is not supported", "pins vLLM 0.32.0", "on 0.31.0")),
        ("0.40.0", True, ("vLLM 0.40.0 has no V1 model runner", "unavailable there")),
    ],
    ids=["unpinned", "without-v1"],
)
def test_unsupported_version(
    project: GeneratedProject, tree: Path, version_set: str, without_v1: bool, phrases: tuple
):
    """A version without pins, or a release that has dropped Model Runner V1: one line says
    that only the V2 lane, which needs no install, runs there."""
    set_version(tree, "vllm", version_set)
    if without_v1:
        (tree / V1_RUNNER).unlink()
    before = snapshot(tree)
    v2_lane = "the V2 lane (upstream vLLM's DSpark, VLLM_USE_V2_MODEL_RUNNER=1) needs no install"
    for mode in ((), ("--status",), ("--status", "--json"), ("--dry-run",)):
        result = project.install(tree, *mode)
        assert_refused(result, ExitCode.REFUSED, "V1 lane is unavailable", *phrases, v2_lane)
        assert len(result.stderr.splitlines()) == 1
    assert snapshot(tree) == before


def test_unknown_distribution_of_a_pinned_version(project: GeneratedProject, tree: Path):
    set_version(tree, "vllm-rocm", "0.32.0")
    before = snapshot(tree)
    result = project.install(tree)
    assert_refused(result, ExitCode.REFUSED, "installed as 'vllm-rocm' is not supported")
    assert snapshot(tree) == before


def add_distribution(tree: Path, name: str, version: str) -> None:
    """A dist-info as pip leaves it (METADATA is what the installer reads)."""
    dist_info = tree / f"{name}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )


def test_pypi_torchvision_beside_cpu_torch_names_the_one_command(
    project: GeneratedProject, tree: Path
):
    add_distribution(tree, "torch", "2.13.0+cpu")
    add_distribution(tree, "torchvision", "0.28.0+cpu")  # the CPU index's build: fine
    add_distribution(tree, "torchaudio", "2.13.0")
    add_distribution(tree, "torchcodec", "0.9.0")
    before = snapshot(tree)
    result = project.install(tree)
    assert (result.returncode, result.stdout, snapshot(tree) == before) == (
        ExitCode.REFUSED,
        "",
        True,
    )
    assert result.stderr == (
        "install.py: error: torch 2.13.0+cpu is PyTorch's CPU build, but torchaudio 2.13.0, "
        "torchcodec 0.9.0 beside it are built for PyPI's torch, so vLLM would stop with "
        f"'operator torchvision::nms does not exist'. Remove them first: {sys.executable} -m pip "
        "uninstall -y torchaudio torchcodec. Nothing was written.\n"
    )


def test_the_companions_of_a_cuda_torch_are_not_refused(project: GeneratedProject, tree: Path):
    """The control: the same packages beside PyPI's torch install."""
    add_distribution(tree, "torch", "2.13.0")
    add_distribution(tree, "torchvision", "0.28.0")
    result = project.install(tree)
    assert result.returncode == ExitCode.OK, result.stderr


def test_dist_info_and_version_file_disagree(project: GeneratedProject, tree: Path):
    version_file = tree / "vllm" / "_version.py"
    replace_file(version_file, version_file.read_bytes().replace(b"'0.32.0'", b"'0.33.0'"))
    before = snapshot(tree)
    result = project.install(tree)
    assert_refused(result, ExitCode.BAD_TARGET, "says vLLM 0.32.0 but vllm/_version.py says 0.33.0")
    assert snapshot(tree) == before


def test_version_from_version_file_without_dist_info(project: GeneratedProject, tree: Path):
    for dist_info in tree.glob("vllm*.dist-info"):
        shutil.rmtree(dist_info)  # copied, not hard-linked
    result = project.install(tree, "--status")
    assert result.returncode == ExitCode.NOT_INSTALLED, result.stderr
    assert "vLLM 0.32.0 (no dist-info)" in result.stdout


def test_patch_target_differs_from_pin(project: GeneratedProject, tree: Path):
    target = tree / SPECULATIVE
    expected = sha256_hex(target.read_bytes())
    edited = target.read_bytes() + b"# a local edit\n"
    replace_file(target, edited)
    before = snapshot(tree)
    result = project.install(tree)
    assert_refused(
        result,
        ExitCode.REFUSED,
        "nothing was changed",
        f"{SPECULATIVE} is not the pinned vLLM 0.32.0 file",
        f"expected sha256 {expected}",
        f"found {sha256_hex(edited)}",
        "pip install --force-reinstall --no-deps",
    )
    assert EAGLE not in result.stderr, "only the differing file is named"
    assert snapshot(tree) == before


def test_patch_target_differs_from_record(project: GeneratedProject, tree: Path):
    """The file matches the pin, but vLLM's own RECORD disagrees: refuse as well."""
    (record,) = tree.glob("vllm*.dist-info/RECORD")
    text = re.sub(
        rf"(?m)^{re.escape(EAGLE)},sha256=[^,]+,", f"{EAGLE},sha256=AAAA,", record.read_text()
    )
    replace_file(record, text.encode())
    before = snapshot(tree)
    result = project.install(tree)
    assert_refused(result, ExitCode.REFUSED, f"{EAGLE} differs from", "RECORD (sha256=AAAA)")
    assert snapshot(tree) == before


def test_overlay_file_already_in_vllm(project: GeneratedProject, tree: Path):
    clash = tree / next(iter(OVERLAY_A))
    clash.parent.mkdir(parents=True)
    clash.write_text("# vLLM's own file\n")
    before = snapshot(tree)
    result = project.install(tree)
    assert_refused(result, ExitCode.REFUSED, f"{next(iter(OVERLAY_A))} already exists")
    assert snapshot(tree) == before


def test_read_only_tree(project: GeneratedProject, tree: Path):
    before = snapshot(tree)
    with unwritable(tree / "vllm"):
        result = project.install(tree)
        status = project.install(tree, "--status")
    assert_refused(
        result, ExitCode.FAILED, "cannot write into the vLLM tree", "Nothing was changed"
    )
    assert status.returncode == ExitCode.NOT_INSTALLED, "status needs no write access"
    assert snapshot(tree) == before


def test_concurrent_run_is_locked_out(project: GeneratedProject, tree: Path):
    before = snapshot(tree)
    descriptor = os.open(tree / "vllm", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        result = project.install(tree)
    finally:
        os.close(descriptor)
    assert_refused(result, ExitCode.FAILED, "another install.py run holds the lock")
    assert snapshot(tree) == before


def test_invalid_pins(project: GeneratedProject, tree: Path, tmp_path: Path):
    project = project.clone(tmp_path / "project")
    pins = project.root / "recipe" / "pins.yaml"
    pins.write_text(re.sub(r"pre_sha256: \w+", "pre_sha256: 1234", pins.read_text(), count=1))
    before = snapshot(tree)
    result = project.install(tree)
    assert_refused(result, ExitCode.FAILED, "pins.yaml is invalid", "not 64 lowercase hex digits")
    assert snapshot(tree) == before


@pytest.mark.parametrize(
    "arguments",
    [["--json"], ["--force"], ["--status", "--uninstall"], ["--dry-run", "--uninstall"]],
)
def test_bad_arguments(project: GeneratedProject, tree: Path, arguments: list[str]):
    before = snapshot(tree)
    result = project.install(tree, *arguments)
    assert result.returncode == ExitCode.BAD_TARGET
    assert "usage: install.py" in result.stderr and "Traceback" not in result.stderr
    assert snapshot(tree) == before


def test_drifted_install_is_refused_until_forced(
    project: GeneratedProject, tree: Path, pristine: Path
):
    assert project.install(tree).returncode == ExitCode.OK
    target = tree / EAGLE
    installed = sha256_hex(target.read_bytes())
    replace_file(target, target.read_bytes() + b"# edited after install\n")
    drifted = snapshot(tree)

    status = project.install(tree, "--status")
    assert status.returncode == ExitCode.DRIFTED
    assert f"drifted       patch   {EAGLE}" in status.stdout
    for mode in ((), ("--uninstall",)):
        result = project.install(tree, *mode)
        assert_refused(
            result, ExitCode.REFUSED, f"{EAGLE} changed after install", installed, "--force"
        )
        assert snapshot(tree) == drifted

    forced = project.install(tree, "--uninstall", "--force")
    assert forced.returncode == ExitCode.OK, forced.stderr
    assert sources(tree) == sources(pristine)


def test_hand_patched_tree_without_record_is_partial(project: GeneratedProject, tree: Path):
    """A patched file without an install record (e.g. copied by hand) is reported, not trusted."""
    assert project.install(tree).returncode == ExitCode.OK
    patched = (tree / SPECULATIVE).read_bytes()
    assert project.install(tree, "--uninstall").returncode == ExitCode.OK
    replace_file(tree / SPECULATIVE, patched)
    before = snapshot(tree)

    status = project.install(tree, "--status")
    assert status.returncode == ExitCode.PARTIAL and "state: partial" in status.stdout
    result = project.install(tree)
    assert_refused(result, ExitCode.REFUSED, f"{SPECULATIVE} is not the pinned vLLM 0.32.0 file")
    result = project.install(tree, "--uninstall")
    assert_refused(result, ExitCode.REFUSED, "no install record", SPECULATIVE, "--force-reinstall")
    assert snapshot(tree) == before


def test_dry_run_refuses_to_plan_over_an_interrupted_run(project: GeneratedProject, tree: Path):
    killed = project.install(tree, env={"DSPARK_INSTALL_KILL_AT": "8"})
    assert killed.returncode == 137 and (tree / JOURNAL).exists()
    before = snapshot(tree)
    result = project.install(tree, "--dry-run")
    assert_refused(result, ExitCode.FAILED, "interrupted run left a journal", "--status")
    assert snapshot(tree) == before


def test_missing_installed_overlay_file_is_drift(project: GeneratedProject, tree: Path):
    assert project.install(tree).returncode == ExitCode.OK
    (tree / next(iter(OVERLAY_A))).unlink()
    status = project.install(tree, "--status")
    assert status.returncode == ExitCode.DRIFTED
    assert f"drifted       overlay {next(iter(OVERLAY_A))}" in status.stdout
    result = project.install(tree)
    assert_refused(result, ExitCode.REFUSED, "changed after install", "found missing")
