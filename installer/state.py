# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The installer's state inside the vLLM tree: install record, journal and original bytes.

Everything lives in `vllm/.dspark-install/` (not importable, ignored by pip):
- `record.json`: what is installed (version, manifest digest, every file with its pre/post hash);
- `journal.json`: present only while a transaction runs; lists every file it touches with its
  hash before and after, so a killed run can be rolled back by the next one;
- `blobs/<sha256>`: the bytes needed to undo (originals of patched files, and during a
  transaction the previous bytes of every touched file), addressed by their hash.
"""

import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

from installer.errors import Refused, RollbackFailed
from installer.fileops import TEMP_SUFFIX, fsync_dir, write_atomic
from installer.hashing import sha256_hex

STATE_DIR = "vllm/.dspark-install"
RECORD = f"{STATE_DIR}/record.json"
JOURNAL = f"{STATE_DIR}/journal.json"
SCHEMA = 1
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class RecordedFile:
    path: str
    kind: str  # "patch" or "overlay"
    pre_sha256: str | None  # None: the file did not exist before (overlay)
    post_sha256: str
    link: str | None = (
        None  # the symbolic link this file was before install (restored by uninstall)
    )


@dataclass(frozen=True)
class Record:
    vllm_version: str
    manifest_digest: str
    files: tuple[RecordedFile, ...]
    created_dirs: tuple[str, ...]  # directories the overlay created, removed on uninstall
    project_version: str | None = None  # dspark-vllm's release (None: recorded before it was)

    def file(self, path: str) -> RecordedFile | None:
        return next((file for file in self.files if file.path == path), None)

    def blob_hashes(self) -> set[str]:
        return {file.pre_sha256 for file in self.files if file.pre_sha256}

    def to_bytes(self) -> bytes:
        document = {"schema": SCHEMA, **asdict(self)}
        for file in document["files"]:
            if file["link"] is None:
                del file["link"]  # records of plain files read as before
        return (json.dumps(document, indent=2) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Record":
        document = _load(data)
        files = tuple(RecordedFile(**file) for file in _list(document, "files", dict))
        for file in files:
            _check_entry(file.path, file.pre_sha256, optional=True)
            _check_entry(file.path, file.post_sha256, optional=False)
        return cls(
            vllm_version=document["vllm_version"],
            manifest_digest=document["manifest_digest"],
            files=files,
            created_dirs=tuple(_list(document, "created_dirs", str)),
            project_version=_optional_str(document, "project_version"),
        )

    def paths(self) -> list[tuple[str, bool]]:
        """Every path in the record, with whether it is a directory."""
        return [
            *((file.path, False) for file in self.files),
            *((d, True) for d in self.created_dirs),
        ]


@dataclass(frozen=True)
class JournalEntry:
    path: str
    before_sha256: str | None  # None: the file did not exist
    after_sha256: str | None
    before_link: str | None = None  # the file was this symbolic link; rollback recreates it


@dataclass(frozen=True)
class Journal:
    operation: str
    entries: tuple[JournalEntry, ...]
    new_dirs: tuple[str, ...]  # directories the transaction creates

    def to_bytes(self) -> bytes:
        return (json.dumps({"schema": SCHEMA, **asdict(self)}, indent=2) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Journal":
        document = _load(data)
        entries = tuple(JournalEntry(**entry) for entry in _list(document, "entries", dict))
        for entry in entries:
            _check_entry(entry.path, entry.before_sha256, optional=True)
            _check_entry(entry.path, entry.after_sha256, optional=True)
        return cls(
            operation=document["operation"],
            entries=entries,
            new_dirs=tuple(_list(document, "new_dirs", str)),
        )

    def paths(self) -> list[tuple[str, bool]]:
        """Every path in the journal, with whether it is a directory."""
        return [
            *((entry.path, False) for entry in self.entries),
            *((d, True) for d in self.new_dirs),
        ]


_State = TypeVar("_State", Record, Journal)


class StateStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.directory = root / STATE_DIR
        self.blobs = self.directory / "blobs"

    def read_record(self) -> Record | None:
        data = self.read_record_bytes()
        return None if data is None else self._decode(Record, data, RECORD)

    def read_record_bytes(self) -> bytes | None:
        try:
            return (self.root / RECORD).read_bytes()
        except FileNotFoundError:
            return None

    def read_journal(self) -> Journal | None:
        try:
            data = (self.root / JOURNAL).read_bytes()
        except FileNotFoundError:
            return None
        return self._decode(Journal, data, JOURNAL)

    def write_journal(self, journal: Journal) -> None:
        write_atomic(self.root / JOURNAL, journal.to_bytes())

    def remove_journal(self) -> None:
        (self.root / JOURNAL).unlink()
        fsync_dir(self.directory)

    def put_blob(self, data: bytes) -> None:
        path = self.blobs / sha256_hex(data)
        if not path.exists() or sha256_hex(path.read_bytes()) != path.name:
            write_atomic(path, data)

    def get_blob(self, sha256: str) -> bytes:
        try:
            data = (self.blobs / sha256).read_bytes()
        except OSError as error:
            raise RollbackFailed(
                f"the saved original {self.blobs / sha256} is lost: {error}"
            ) from error
        if sha256_hex(data) != sha256:
            raise RollbackFailed(f"the saved original {self.blobs / sha256} is corrupt")
        return data

    def collect_garbage(self) -> None:
        """Drop temp files and blobs nothing refers to; drop the whole directory when no
        install or transaction is left. Writes nothing when there is nothing to drop."""
        if not self.directory.exists() or self.read_journal() is not None:
            return
        record = self.read_record()
        if record is None:
            shutil.rmtree(self.directory)
            fsync_dir(self.directory.parent)
            return
        keep = record.blob_hashes()
        for path in list(self.directory.rglob("*")):
            unused_blob = path.parent == self.blobs and path.name not in keep
            if unused_blob or path.name.endswith(TEMP_SUFFIX):
                path.unlink()

    def _decode(self, kind: type[_State], data: bytes, relpath: str) -> _State:
        try:
            state = kind.from_bytes(data)
        except (ValueError, KeyError, TypeError) as error:
            raise RollbackFailed(f"{relpath} is corrupt ({error}). {MANUAL_REPAIR}") from error
        for path, directory in state.paths():
            problem = outside_reason(self.root, path, directory)
            if problem:
                raise Refused(
                    f"{relpath} lists {path!r}, which {problem}: refusing to write or delete "
                    f"anything; nothing was changed. {MANUAL_REPAIR}"
                )
        return state


MANUAL_REPAIR = (
    f"Reinstall vLLM with `pip install --force-reinstall --no-deps`, then delete {STATE_DIR} "
    f"and the overlay files."
)


def outside_reason(root: Path, relpath: str, directory: bool = False) -> str | None:
    """Why `relpath` (a path from a state file, or one install.py is about to touch) does not
    name an entry strictly inside the vllm package under `root`; None when it does.

    A file is replaced or unlinked in its directory, never written through, so its directory
    must resolve inside the package (a symbolic link on the way out counts as outside) while
    the file itself may be a link; a directory (pruned with its __pycache__) must resolve
    inside itself."""
    parts = relpath.split("/")
    if parts[0] != "vllm" or len(parts) < 2 or {"", ".", ".."} & set(parts) or "\\" in relpath:
        return "is not a plain relative path inside vllm/"
    package = root / "vllm"
    path = root / relpath
    try:
        inside = (path if directory else path.parent).resolve().is_relative_to(package.resolve())
    except (OSError, RuntimeError, ValueError) as error:  # a link loop, a NUL byte, too long
        return f"cannot be resolved ({error})"
    return None if inside else f"resolves outside {package}"


def _load(data: bytes) -> dict:
    document = json.loads(data)
    if not isinstance(document, dict):
        raise ValueError(f"a JSON {type(document).__name__}, not an object")
    if document.get("schema") != SCHEMA:
        raise ValueError(f"schema {document.get('schema')!r}, expected {SCHEMA}")
    return document


def _list(document: dict, key: str, item: type) -> list:
    value = document[key]
    if not isinstance(value, list) or not all(isinstance(entry, item) for entry in value):
        raise ValueError(f"{key!r} is not a list of {item.__name__}")
    return value


def _optional_str(document: dict, key: str) -> str | None:
    value = document.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key!r} is not a string")
    return value


def _check_entry(path: object, sha256: object, optional: bool) -> None:
    """Paths are strings and hashes hex digests (a hash names a blob file: no `../` there)."""
    if not isinstance(path, str):
        raise ValueError(f"path {path!r} is not a string")
    if sha256 is None and optional:
        return
    if not isinstance(sha256, str) or not SHA256_HEX.fullmatch(sha256):
        raise ValueError(f"{path}: {sha256!r} is not a sha256")
