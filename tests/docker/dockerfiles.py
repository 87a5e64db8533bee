# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""A small reader of the project's Dockerfiles, enough to check what they pin, set and copy."""

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = {
    "spark": REPO / "docker" / "spark.Dockerfile",
    "blackwell": REPO / "docker" / "blackwell.Dockerfile",
}
VLLM_033_DIST_INFO = REPO / ".cache" / "vllm-0.33.0" / "vllm-0.33.0.dist-info"
# Machine code per image, by vLLM extension role and for torch and FlashInfer, that the CPU
# stand-in builds pass as ARCH_LISTING_JSON (the stand-in's vLLM is the CPU build);
# test_docker_arch_verify.py shows the step fails when a target or a role is dropped.
FAKE_CODE = {
    "spark": {
        "torch": {"sass": ["sm_121a"], "ptx": []},
        "core": {"sass": ["sm_120"], "ptx": []},
        "moe": {"sass": ["sm_121a"], "ptx": []},
        "flashinfer/flashinfer_kernels.so": {"sass": [], "ptx": ["compute_90"]},
    },
    "blackwell": {
        "torch": {"sass": ["sm_100a", "sm_103a", "sm_120a"], "ptx": []},
        "core": {"sass": ["sm_100", "sm_120"], "ptx": []},
        "moe": {"sass": ["sm_100f", "sm_120"], "ptx": []},
    },
}
# Extensions built for one architecture on purpose: listed, never required.
OTHER_EXTENSION_CODE = {"sass": ["sm_90a"], "ptx": []}


def vllm_033_record() -> tuple[str, str, list[str]]:
    """(name, version, the RECORD's `.so` paths) of the vLLM 0.33.0 wheel setup unpacked."""
    from importlib.metadata import PathDistribution

    if not VLLM_033_DIST_INFO.is_dir():
        pytest.fail(f"{VLLM_033_DIST_INFO} is missing: run scripts/setup-cpu-env.sh")
    dist = PathDistribution(VLLM_033_DIST_INFO)
    files = [str(path) for path in dist.files or [] if str(path).endswith(".so")]
    return dist.metadata["Name"], dist.version, files


def fake_listing(name: str) -> dict:
    """`--listing-json` for image `name`: the 0.33.0 wheel's RECORD, with each extension of a
    role carrying that role's code and every other extension code for sm_90a only."""
    from tools.gpu_selftest.architectures import extension_roles

    dist_name, version, files = vllm_033_record()
    code = FAKE_CODE[name]
    roles = extension_roles(files)
    binaries = {key: value for key, value in code.items() if key not in roles}  # torch, FlashInfer
    for path in files:
        role = next((role for role, paths in roles.items() if path in paths), None)
        binaries[path] = code[role] if role else OTHER_EXTENSION_CODE
    return {"name": dist_name, "version": version, "files": files, "binaries": binaries}


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
