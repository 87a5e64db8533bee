# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Prove that install.py left a complete DSpark install in a vLLM tree: the last step of
docker/install-and-verify.sh, and so of every image build.

Checks, each failing with a message that names the problem:
- `install.py --status --json` exits 0 and reports the state "installed";
- the installed vLLM version and pin digest equal the ones the image is labelled with (if given);
- every Python module of the overlay listed in recipe/pins.yaml imports, from that tree.
The module list comes from the installer's own reader of recipe/pins.yaml, so it is never copied.

With `--architectures "sm_121"` it instead proves the image's GPU code: the build's JIT arch
lists (TORCH_CUDA_ARCH_LIST, FLASHINFER_CUDA_ARCH_LIST) cover every target; the installed vLLM is
a CUDA build whose RECORD lists its core and MoE extensions (by role: `_C*`, `_moe_C*`); and
torch and each of those extensions carry machine code or PTX for each target, and FlashInfer
machine code, nvcc to JIT-compile or flashinfer-cubin (`tools/gpu_selftest/architectures.py`:
torch's compiled arch flags, the fat binaries of the `.so` files read by `tools/fatbin.py`).
`--listing-json` replaces vLLM's RECORD and the binaries' listing: the CPU stand-in build, whose
vLLM is the CPU build, passes one made from the vLLM 0.33.0 wheel's RECORD (tests/docker).
"""

import argparse
import importlib
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path, PurePosixPath

from packaging.version import Version

# The project root (/opt/dspark in an image), for the installer and tools packages, ahead of
# any other package of those names on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from installer.errors import InstallerError
from installer.pins import load as load_pins

PROJECT = Path(__file__).resolve().parent.parent


class VerifyError(Exception):
    """The install is incomplete or does not match the image's labels."""


def install_status(target: list[str]) -> dict:
    """`install.py --status --json` for the target tree; refuse anything but a complete install."""
    command = [sys.executable, str(PROJECT / "install.py"), *target, "--status", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    try:
        status = json.loads(result.stdout)
    except json.JSONDecodeError as error:
        raise VerifyError(
            f"install.py --status --json printed no JSON (exit {result.returncode}): "
            f"{result.stderr.strip() or result.stdout.strip()}"
        ) from error
    if result.returncode != 0 or status.get("state") != "installed":
        raise VerifyError(
            f"install.py --status reports {status.get('state')!r} (exit {result.returncode}), "
            "not 'installed'; run install.py again and read its message"
        )
    return status


def check_labels(status: dict, vllm_version: str, pin_digest: str) -> None:
    """The labels an image carries must describe what was installed in it."""
    # Compare public versions: a local build may add a suffix such as "+cu130".
    if vllm_version and Version(status["vllm_version"]).public != vllm_version:
        raise VerifyError(
            f"the image is labelled vLLM {vllm_version} but its base carries vLLM "
            f"{status['vllm_version']}: make VLLM_VERSION match the BASE_IMAGE tag"
        )
    if pin_digest and status["digest"] != pin_digest:
        raise VerifyError(
            f"the image is labelled with pin digest {pin_digest} but the install has "
            f"{status['digest']}: pass the digest of this project revision (docs/docker.md)"
        )


def overlay_modules() -> list[str]:
    """Dotted names of the Python modules the overlay adds, e.g. vllm.v1.spec_decode.dspark.ring."""
    modules = []
    for path in load_pins(PROJECT).overlay:
        parts = PurePosixPath(path).with_suffix("").parts
        if path.endswith(".py"):
            modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return modules


def import_from_tree(modules: list[str], vllm_dir: Path) -> None:
    """Import each module and check it came from `vllm_dir`, not from some other vllm."""
    for name in modules:
        try:
            module = importlib.import_module(name)
        except Exception as error:
            traceback.print_exc()
            raise VerifyError(f"{name} does not import: {error!r}") from error
        # Unresolved paths: the question is which tree Python imported from, and
        # a tree's files may legitimately be symlinks into another one.
        origin = Path(module.__file__).absolute()
        if not origin.is_relative_to(vllm_dir.absolute()):
            raise VerifyError(f"{name} was imported from {origin}, outside {vllm_dir}")


def listed_build(listing_json: str):
    """The vLLM build and binaries' listing of `--listing-json`: {"name", "version", "files" (the
    RECORD's paths), "binaries" ({path: {"sass": [...], "ptx": [...]}})}."""
    from tools.gpu_selftest.architectures import VllmBuild

    try:
        given = json.loads(listing_json)
        build = VllmBuild(given["name"], given["version"], list(given["files"]), None)
        return build, dict(given["binaries"])
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise VerifyError(
            f"--listing-json is not an object with name, version, files and binaries: {error!r}"
        ) from None


def check_architectures(targets_text: str, listing_json: str) -> str:
    """Refuse an image whose arch lists, vLLM build or binaries have no code for a target."""
    from tools.gpu_selftest import architectures as arch

    targets = []
    for token in targets_text.split():
        parsed = arch.parse_arch(token)
        if parsed is None:
            raise VerifyError(f"--architectures: {token!r} is not an architecture like sm_121")
        targets.append(parsed[:2])
    problems = []
    for name in ("TORCH_CUDA_ARCH_LIST", "FLASHINFER_CUDA_ARCH_LIST"):
        problems += arch.jit_list_problems(name, os.environ.get(name, ""), targets)
    if listing_json:
        build, listing = listed_build(listing_json)
    else:
        try:
            build = arch.VllmBuild.installed()
        except LookupError as error:
            raise VerifyError(f"no vLLM to check: {error}") from None
        listing = arch.collect_listing(build)
    roles, build_problems = arch.extension_problems(build)
    if build_problems:
        raise VerifyError("; ".join(problems + build_problems))
    verdicts = {}
    for target in targets:
        verdicts[target], missing = arch.architecture_problems(listing, target, roles)
        name = arch.format_arch(target)
        problems += [f"{binary} carries no machine code or PTX for {name}" for binary in missing]
    if problems:
        raise VerifyError("; ".join(problems))
    required = ["torch", *(path for paths in roles.values() for path in paths)]
    return "; ".join(
        f"{arch.format_arch(target)}: "
        + ", ".join(f"{binary} {found[binary]}" for binary in required)
        for target, found in verdicts.items()
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-path", help="as for install.py (default: this Python's vllm)")
    parser.add_argument("--expect-vllm-version", default="", help="required vLLM version")
    parser.add_argument("--expect-pin-digest", default="", help="required install digest")
    parser.add_argument(
        "--architectures", help='check only the GPU code for these targets, e.g. "sm_121"'
    )
    parser.add_argument("--listing-json", default="", help="binaries' listing (CPU stand-in)")
    args = parser.parse_args()
    if args.architectures is not None:
        try:
            summary = check_architectures(args.architectures, args.listing_json)
        except VerifyError as error:
            print(f"verify: FAILED: {error}", file=sys.stderr)
            return 1
        print(f"verify: ok: GPU code for {args.architectures}: {summary}")
        return 0
    target = [] if args.vllm_path is None else ["--vllm-path", args.vllm_path]
    try:
        status = install_status(target)
        check_labels(status, args.expect_vllm_version, args.expect_pin_digest)
        modules = overlay_modules()
        # Import from the tree install.py patched, ahead of any other vllm on sys.path.
        vllm_dir = Path(status["vllm_path"])
        sys.path.insert(0, str(vllm_dir.parent))
        import_from_tree(modules, vllm_dir)
    except (VerifyError, InstallerError) as error:
        print(f"verify: FAILED: {error}", file=sys.stderr)
        return 1
    print(
        f"verify: ok: vLLM {status['vllm_version']}, DSpark installed (digest {status['digest']}), "
        f"{len(modules)} overlay module(s) import"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
