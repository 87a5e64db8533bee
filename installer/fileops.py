# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Durable file operations: same-directory temp file, fsync, os.replace, fsync of the directory.

A reader (or a crash) sees either the old or the new bytes of a file, never a mix.
"""

import os
import py_compile
import shutil
from pathlib import Path

from installer.faults import checkpoint

TEMP_SUFFIX = ".dspark-tmp"
NEW_FILE_MODE = 0o644


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}{TEMP_SUFFIX}")


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = NEW_FILE_MODE
    temp = temp_path(path)
    with open(temp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fchmod(handle.fileno(), mode)
        os.fsync(handle.fileno())
    checkpoint(f"temp file of {path.name} written")
    os.replace(temp, path)
    fsync_dir(path.parent)


def replace_with_symlink(path: Path, target: str) -> None:
    """Make `path` the symbolic link `target` again, atomically like write_atomic."""
    temp = temp_path(path)
    temp.unlink(missing_ok=True)
    os.symlink(target, temp)
    checkpoint(f"link for {path.name} made")
    os.replace(temp, path)
    fsync_dir(path.parent)


def remove(path: Path) -> None:
    """Remove a file and, for a module, its compiled copies in __pycache__."""
    path.unlink(missing_ok=True)
    remove_bytecode(path)
    fsync_dir(path.parent)


def remove_bytecode(source: Path) -> None:
    if source.suffix != ".py":
        return
    for compiled in (source.parent / "__pycache__").glob(f"{source.stem}.*.pyc"):
        compiled.unlink(missing_ok=True)


def compile_python(path: Path) -> None:
    """Byte-compile like pip does after installing a wheel; raises PyCompileError."""
    if path.suffix == ".py":
        py_compile.compile(str(path), doraise=True)


def prune_dirs(directories: list[Path]) -> None:
    """Remove directories that hold nothing but bytecode caches, deepest first."""
    for directory in sorted(directories, key=lambda path: len(path.parts), reverse=True):
        if not directory.is_dir():
            continue
        entries = list(directory.iterdir())
        if any(entry.name != "__pycache__" for entry in entries):
            continue
        for cache in entries:
            shutil.rmtree(cache)
        directory.rmdir()
        fsync_dir(directory.parent)


def fsync_dir(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
