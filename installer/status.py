# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Classify a tree as installed, not installed, partial or drifted, file by file.

The digest covers the vLLM version and the current bytes of every file the project manages, so
two nodes print the same digest exactly when their DSpark-relevant files are identical.
"""

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from installer.errors import ExitCode
from installer.hashing import sha256_hex
from installer.manifest import Manifest
from installer.state import Record, RecordedFile
from installer.vllm_tree import VllmTree

INSTALLED = "installed"
NOT_INSTALLED = "not-installed"
PARTIAL = "partial"
DRIFTED = "drifted"
EXIT_CODES = {
    INSTALLED: ExitCode.OK,
    NOT_INSTALLED: ExitCode.NOT_INSTALLED,
    PARTIAL: ExitCode.PARTIAL,
    DRIFTED: ExitCode.DRIFTED,
}


@dataclass(frozen=True)
class FileStatus:
    path: str
    kind: str  # "patch" or "overlay"
    state: str  # "installed", "not-installed" or "drifted"
    expected_sha256: str | None  # the installed bytes' hash; None: must be absent
    actual_sha256: str | None  # None: absent


@dataclass(frozen=True)
class Status:
    state: str
    dspark_version: str | None  # the release recorded at install; None: none recorded
    vllm_version: str
    vllm_path: str
    distribution: str | None
    digest: str
    manifest_digest: str
    files: tuple[FileStatus, ...]
    notes: tuple[str, ...]

    @property
    def exit_code(self) -> ExitCode:
        return EXIT_CODES[self.state]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def to_text(self) -> str:
        lines = [
            f"vLLM {self.vllm_version} ({self.distribution or 'no dist-info'}) at {self.vllm_path}",
            f"state: {self.state}",
            f"dspark-vllm: {self.dspark_version or 'no release recorded'}",
        ]
        lines += [f"  {file.state:<13} {file.kind:<7} {file.path}" for file in self.files]
        lines += [f"note: {note}" for note in self.notes]
        lines.append(f"digest: {self.digest}")
        return "\n".join(lines)


def evaluate(
    tree: VllmTree, manifest: Manifest, record: Record | None, interrupted: bool
) -> Status:
    files = {file.path: _recorded_status(tree, file) for file in (record.files if record else ())}
    for file in _manifest_files(tree, manifest):
        files.setdefault(file.path, file)
    notes = []
    states = {file.state for file in files.values()}
    if interrupted:
        state = PARTIAL
        notes.append("an interrupted run left a journal; any install.py run repairs it")
    elif DRIFTED in states:
        state = DRIFTED
        notes.append("files differ from what was installed; see install.py --uninstall --force")
    elif record is None:
        state = NOT_INSTALLED if states <= {NOT_INSTALLED} else PARTIAL
    elif record.manifest_digest != manifest.digest:
        state = PARTIAL
        notes.append("installed by another project revision; run install.py to upgrade")
    else:
        state = INSTALLED
    identity = {
        "vllm_version": tree.version,
        "installed_manifest": record.manifest_digest if record else None,
        "files": {path: file.actual_sha256 for path, file in sorted(files.items())},
    }
    return Status(
        state=state,
        dspark_version=record.project_version if record else None,
        vllm_version=tree.version,
        vllm_path=str(tree.package_dir),
        distribution=tree.dist_info.name if tree.dist_info else None,
        digest=sha256_hex(json.dumps(identity, sort_keys=True).encode()),
        manifest_digest=manifest.digest,
        files=tuple(files[path] for path in sorted(files)),
        notes=tuple(notes),
    )


def _manifest_files(tree: VllmTree, manifest: Manifest) -> Iterator[FileStatus]:
    for target, (pristine, installed) in manifest.patched_targets().items():
        yield _file_status(tree, target, "patch", installed, pristine)
    for overlay in manifest.overlay:
        yield _file_status(tree, overlay.path, "overlay", sha256_hex(overlay.data), None)


def _recorded_status(tree: VllmTree, file: RecordedFile) -> FileStatus:
    """A recorded file must hold what was installed; anything else is drift, even vLLM's
    original (e.g. after a pip reinstall over the install)."""
    status = _file_status(tree, file.path, file.kind, file.post_sha256, None)
    return status if status.state == INSTALLED else dataclasses.replace(status, state=DRIFTED)


def _file_status(
    tree: VllmTree, path: str, kind: str, installed: str, pristine: str | None
) -> FileStatus:
    """`pristine` is vLLM's own hash of the file; None: vLLM has no such file."""
    data = tree.read(path)
    actual = None if data is None else sha256_hex(data)
    if actual == installed:
        state = INSTALLED
    elif actual == pristine:
        state = NOT_INSTALLED
    else:
        state = DRIFTED
    return FileStatus(path, kind, state, installed, actual)
