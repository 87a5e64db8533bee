"""The installer's state inside the vLLM tree: install record, journal and original bytes.

Everything lives in `vllm/.dspark-install/` (not importable, ignored by pip):
- `record.json`: what is installed (version, manifest digest, every file with its pre/post hash);
- `journal.json`: present only while a transaction runs; lists every file it touches with its
  hash before and after, so a killed run can be rolled back by the next one;
- `blobs/<sha256>`: the bytes needed to undo (originals of patched files, and during a
  transaction the previous bytes of every touched file), addressed by their hash.
"""

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from installer.errors import RollbackFailed
from installer.fileops import TEMP_SUFFIX, fsync_dir, write_atomic
from installer.hashing import sha256_hex

STATE_DIR = "vllm/.dspark-install"
RECORD = f"{STATE_DIR}/record.json"
JOURNAL = f"{STATE_DIR}/journal.json"
SCHEMA = 1


@dataclass(frozen=True)
class RecordedFile:
    path: str
    kind: str  # "patch" or "overlay"
    pre_sha256: str | None  # None: the file did not exist before (overlay)
    post_sha256: str


@dataclass(frozen=True)
class Record:
    vllm_version: str
    manifest_digest: str
    files: tuple[RecordedFile, ...]
    created_dirs: tuple[str, ...]  # directories the overlay created, removed on uninstall

    def file(self, path: str) -> RecordedFile | None:
        return next((file for file in self.files if file.path == path), None)

    def blob_hashes(self) -> set[str]:
        return {file.pre_sha256 for file in self.files if file.pre_sha256}

    def to_bytes(self) -> bytes:
        document = {"schema": SCHEMA, **asdict(self)}
        return (json.dumps(document, indent=2) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Record":
        document = json.loads(data)
        _check_schema(document)
        return cls(
            vllm_version=document["vllm_version"],
            manifest_digest=document["manifest_digest"],
            files=tuple(RecordedFile(**file) for file in document["files"]),
            created_dirs=tuple(document["created_dirs"]),
        )


@dataclass(frozen=True)
class JournalEntry:
    path: str
    before_sha256: str | None  # None: the file did not exist
    after_sha256: str | None


@dataclass(frozen=True)
class Journal:
    operation: str
    entries: tuple[JournalEntry, ...]
    new_dirs: tuple[str, ...]  # directories the transaction creates

    def to_bytes(self) -> bytes:
        return (json.dumps({"schema": SCHEMA, **asdict(self)}, indent=2) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Journal":
        document = json.loads(data)
        _check_schema(document)
        return cls(
            operation=document["operation"],
            entries=tuple(JournalEntry(**entry) for entry in document["entries"]),
            new_dirs=tuple(document["new_dirs"]),
        )


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

    @staticmethod
    def _decode(kind: type, data: bytes, relpath: str):
        try:
            return kind.from_bytes(data)
        except (ValueError, KeyError, TypeError) as error:
            raise RollbackFailed(
                f"{relpath} is corrupt ({error}). Reinstall vLLM with `pip install "
                f"--force-reinstall --no-deps`, then delete {STATE_DIR} and the overlay files."
            ) from error


def _check_schema(document: dict) -> None:
    if document.get("schema") != SCHEMA:
        raise ValueError(f"schema {document.get('schema')!r}, expected {SCHEMA}")
