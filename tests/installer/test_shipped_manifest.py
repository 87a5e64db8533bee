# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The manifest this checkout ships (recipe/pins.yaml, overlay/, patches/), whatever it holds
today: it is complete, it installs and uninstalls byte-identically on real vLLM 0.32.0 and
0.33.0 trees, and the test environment's vLLM has it installed."""

import json
from pathlib import Path

from installer import pins as pins_module
from installer.errors import ExitCode
from tests.installer.installer_testlib import (
    REPO,
    SETUP_HINT,
    environment_tree,
    record_problems,
    run_installer,
    sources,
)


def test_pins_list_every_shipped_overlay_file_and_patch():
    pins = pins_module.load(REPO)
    overlay_root = REPO / "overlay"
    shipped = sorted(
        path.relative_to(overlay_root).as_posix()
        for path in overlay_root.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    )
    hint = "run tools/refresh_pins.py to update recipe/pins.yaml"
    assert sorted(pins.overlay) == shipped, hint
    for version in pins.versions:
        shipped_patches = pins_module.patch_files(REPO, version.version)
        listed = [REPO / patch.patch for patch in version.patches]
        assert listed == shipped_patches, hint
    assert {version.version for version in pins.versions} >= {"0.32.0", "0.33.0"}


def release() -> str:
    """The project's release as the overlay states it (``__version__``)."""
    from installer.manifest import VERSION_MODULE
    from installer.vllm_tree import version_assigned_in

    version = version_assigned_in((REPO / "overlay" / VERSION_MODULE).read_text())
    assert version and version[0].isdigit(), version
    return version


def test_the_release_is_the_changelogs_latest():
    assert f"## {release()} " in (REPO / "CHANGELOG.md").read_text()


def test_shipped_manifest_installs_and_uninstalls(tree: Path, pristine: Path, version: str):
    result = run_installer(REPO, "--vllm-path", str(tree))
    assert result.returncode == ExitCode.OK, result.stderr
    status = run_installer(REPO, "--vllm-path", str(tree), "--status", "--json")
    assert status.returncode == ExitCode.OK, status.stdout
    report = json.loads(status.stdout)
    assert (report["state"], report["vllm_version"]) == ("installed", version)
    assert report["dspark_version"] == release()
    text = run_installer(REPO, "--vllm-path", str(tree), "--status").stdout
    assert f"dspark-vllm: {release()}" in text.splitlines()
    pins = pins_module.load(REPO).for_tree(version, None)
    assert {file["path"] for file in report["files"]} == {
        *(patch.target for patch in pins.patches),
        *pins_module.load(REPO).overlay,
    }

    result = run_installer(REPO, "--vllm-path", str(tree), "--uninstall")
    assert result.returncode == ExitCode.OK, result.stderr
    assert record_problems(tree) == []
    assert sources(tree) == sources(pristine)


def test_environment_vllm_has_the_shipped_manifest_installed():
    environment = environment_tree()
    result = run_installer(REPO, "--status", "--json")
    found = json.loads(result.stdout)["state"] if result.stdout else result.stderr.strip()
    assert result.returncode == ExitCode.OK, (
        f"the environment's vLLM at {environment.package_dir} does not have this checkout's "
        f"DSpark manifest installed (state: {found}); {SETUP_HINT} again"
    )
    assert json.loads(result.stdout)["vllm_path"] == str(environment.package_dir)
