#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Rewrite recipe/pins.yaml from the patches and overlay files in this checkout.

For every version listed in recipe/pins.yaml:
- its patches are all `*.patch` (or `*.diff`) files in `patches/vllm-<version>/`, applied in
  file-name order
  (prefix names with numbers to order them); each diff's header names its target file;
- each target is read from a pristine vLLM tree of that version and must match vLLM's RECORD;
  its sha256 before and after the patch are written as pre_sha256 and post_sha256;
- the overlay list becomes every file under `overlay/` (bytecode caches excluded).

Trees: `--tree VERSION=PATH` (site-packages or the vllm package), else the vllm of the Python
running this tool when its version matches, else `.cache/vllm-<version>` (made by
scripts/setup-cpu-env.sh). A tree that has DSpark installed is fine: the saved originals are used.

Usage: .venv/bin/python tools/refresh_pins.py [--tree 0.33.0=/path/to/site-packages]
"""

import argparse
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))

import yaml  # noqa: E402

from installer import pins as pins_module  # noqa: E402
from installer.errors import BadTarget, InstallerError  # noqa: E402
from installer.hashing import sha256_hex  # noqa: E402
from installer.pins import PatchPin, Pins, VersionPins  # noqa: E402
from installer.state import Record, StateStore  # noqa: E402
from installer.unified_diff import PatchError, parse  # noqa: E402
from installer.vllm_tree import VllmTree, locate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="VERSION=PATH",
        help="the pristine vLLM tree to hash for VERSION (repeatable)",
    )
    args = parser.parse_args(argv)
    try:
        trees = dict(_split_tree_argument(value) for value in args.tree)
        old = _load_raw_versions()
        versions = tuple(
            _refresh_version(version, distributions, _tree_for(version, trees))
            for version, distributions in old.items()
        )
        pins = Pins(overlay=_overlay_files(), versions=versions)
        (PROJECT / pins_module.PINS_FILE).write_text(_header() + pins_module.dump(pins))
        pins_module.load(PROJECT)  # the result must pass the installer's own validation
    except InstallerError as error:
        print(f"refresh_pins.py: error: {error}", file=sys.stderr)
        return error.exit_code
    for version in versions:
        print(f"vLLM {version.version}: {len(version.patches)} patch(es)")
        for patch in version.patches:
            print(f"  {patch.patch} -> {patch.target} (post sha256 {patch.post_sha256[:16]}...)")
    print(f"overlay: {len(pins.overlay)} file(s)")
    print(
        f"wrote {pins_module.PINS_FILE}; run install.py (or scripts/setup-cpu-env.sh) to apply it"
    )
    return 0


def _refresh_version(version: str, distributions: list[str], tree: VllmTree) -> VersionPins:
    store = StateStore(tree.root)
    record = store.read_record()
    patches = []
    current: dict[str, bytes] = {}  # each patched file after the patches so far
    for patch_file in pins_module.patch_files(PROJECT, version):
        relative = str(patch_file.relative_to(PROJECT))
        try:
            diff = parse(patch_file.read_bytes())
        except PatchError as error:
            raise InstallerError(f"{relative}: {error}") from error
        if diff.new_path != diff.old_path:
            raise InstallerError(f"{relative} renames {diff.old_path}; patches must not rename")
        if diff.old_path in current:
            original = current[diff.old_path]
        else:
            original = _pristine(tree, store, record, diff.old_path, relative)
        try:
            patched = diff.apply(original)
            if diff.old_path.endswith(".py"):
                compile(patched, diff.old_path, "exec")
        except (PatchError, SyntaxError) as error:
            raise InstallerError(f"{relative} does not apply to vLLM {version}: {error}") from error
        current[diff.old_path] = patched
        patches.append(PatchPin(diff.old_path, relative, sha256_hex(original), sha256_hex(patched)))
    return VersionPins(version, tuple(distributions), tuple(patches))


def _pristine(
    tree: VllmTree, store: StateStore, record: Record | None, path: str, patch: str
) -> bytes:
    """vLLM's original of `path`: the saved one if DSpark is installed, proven by RECORD."""
    recorded = record.file(path) if record else None
    saved = recorded.pre_sha256 if recorded else None
    original = store.get_blob(saved) if saved else tree.read(path)
    if original is None:
        raise InstallerError(f"{patch}: {path} does not exist in {tree.root}")
    if tree.dist_info is None or path not in tree.dist_info.record:
        raise InstallerError(f"{tree.root} has no RECORD entry for {path}")
    mismatch = tree.record_mismatch(path, original)
    if mismatch:
        raise InstallerError(f"{tree.root} is not pristine: {mismatch}")
    return original


def _tree_for(version: str, trees: dict[str, Path]) -> VllmTree:
    candidates = (
        [trees[version]] if version in trees else [None, PROJECT / ".cache" / f"vllm-{version}"]
    )
    for candidate in candidates:
        try:
            tree = locate(candidate)
        except BadTarget:
            continue
        if tree.version == version:
            return tree
    raise InstallerError(
        f"no vLLM {version} tree found; pass --tree {version}=/path/to/site-packages"
    )


def _split_tree_argument(value: str) -> tuple[str, Path]:
    version, separator, path = value.partition("=")
    if not separator:
        raise InstallerError(f"--tree expects VERSION=PATH, got {value!r}")
    return version, Path(path)


def _load_raw_versions() -> dict[str, list[str]]:
    """Versions and wheel names, read without validating hashes (they may be stale)."""
    document = yaml.safe_load((PROJECT / pins_module.PINS_FILE).read_text(encoding="utf-8"))
    return {
        str(version): list(body["distributions"]) for version, body in document["versions"].items()
    }


def _overlay_files() -> tuple[str, ...]:
    root = PROJECT / "overlay"
    files = [path.relative_to(root) for path in root.rglob("*") if path.is_file()]
    return tuple(sorted(path.as_posix() for path in files if not _is_cache(path)))


def _is_cache(path: Path) -> bool:
    """Bytecode and tool caches (__pycache__, .pytest_cache, ...) are never shipped."""
    return path.suffix == ".pyc" or any(
        part.endswith(("_cache", "_cache__")) for part in path.parts
    )


def _header() -> str:
    text = (PROJECT / pins_module.PINS_FILE).read_text(encoding="utf-8")
    comments = [line for line in text.splitlines(keepends=True) if line.startswith("#")]
    return "".join(comments)


if __name__ == "__main__":
    sys.exit(main())
