# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""What an operator hands the project, read and quoted safely: files and text.

Files (site file, profiles, secret files, a checkpoint's `config.json`) are opened without
blocking, read only when they are regular files (a symlink to one counts), and only up to a
bound: a FIFO would hang the reader with no output, a device or a huge file would be read until
memory runs out. Anything else is refused in one line that says what the path is.

Text from a file or an argument is quoted through `escaped` (or `shown`, its `repr` form): one
line, no control characters, cut to a bound, so that no message can end with a line the operator
would read as the program's own ("ok: all checks passed" after a line break in a YAML key).
Standard library only: the installer, the launcher, the image's entrypoint and the scripts the
launcher runs on a node import it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import NamedTuple

MAX_SHOWN = 80
"""Longest excerpt of a value any message shows."""
MAX_PATH_SHOWN = 400
"""Longest excerpt of a path or a free text any message shows."""

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def escaped(text: str, limit: int = MAX_PATH_SHOWN) -> str:
    """`text` on one line: every character that is not printable (line breaks of any kind, tabs,
    terminal escapes, NUL, undecodable bytes) written as its Python escape, and the whole cut to
    `limit` characters with `...`."""
    out = "".join(
        char if char.isprintable() else char.encode("unicode_escape", "backslashreplace").decode()
        for char in text
    )
    return out if len(out) <= limit else out[: limit - 3] + "..."


def shown(value: object) -> str:
    """A value from a file or an argument as a message quotes it: its `repr`, escaped and cut to
    `MAX_SHOWN` characters."""
    return escaped(repr(value), MAX_SHOWN)


def cut(text: str, limit: int = 2 * MAX_SHOWN) -> str:
    """`text` as is, or its start and `...` when longer than `limit` (for text that is not a
    message: a key matched against option names)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


class NotReadable(ValueError):
    """The path is not a regular file that can be read within the bound; the message names the
    path and what it is, on one line."""


class RegularFile(NamedTuple):
    data: bytes
    mode: int
    """Permission bits (`stat.S_IMODE`) of the file read."""


def describe(path: Path) -> str:
    """What `path` is when it is not a readable regular file: 'is a FIFO', 'does not exist',
    'is a loop of symlinks', ..."""
    try:
        return f"is {_kind(os.stat(path).st_mode)}"
    except OSError as error:
        return _os_error(error)


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def _os_error(error: OSError) -> str:
    if error.errno == errno.ENOENT:
        return "does not exist"
    if error.errno == errno.ELOOP:
        return "is a loop of symlinks"
    if error.errno == errno.ENOTDIR:
        return "does not exist (a folder on its path is a file)"
    if error.errno == errno.EACCES:
        return "cannot be read (permission denied)"
    return f"cannot be read ({escaped(error.strerror or str(error))})"


def read_regular(path: Path, limit: int) -> RegularFile:
    """The bytes of the regular file at `path`, at most `limit` of them; `NotReadable` for
    anything else. Opened with O_NONBLOCK so that a FIFO answers at once instead of waiting for a
    writer, and checked on the open descriptor so that the file read is the file checked."""
    name = escaped(str(path))
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as error:
        kind = describe(path) if error.errno == errno.ENXIO else _os_error(error)  # a socket
        raise NotReadable(f"{name}: {kind}") from None
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise NotReadable(f"{name}: is {_kind(status.st_mode)}, not a regular file")
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(descriptor, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as error:
        raise NotReadable(f"{name}: {_os_error(error)}") from None
    finally:
        os.close(descriptor)
    data = b"".join(chunks)
    if len(data) > limit:
        raise NotReadable(f"{name}: larger than {limit} bytes, the most read from it")
    return RegularFile(data, stat.S_IMODE(status.st_mode))


def read_text(path: Path, limit: int) -> tuple[str, int]:
    """`read_regular`'s text, which must be UTF-8, and permission bits."""
    found = read_regular(path, limit)
    try:
        return found.data.decode("utf-8"), found.mode
    except UnicodeDecodeError as error:
        raise NotReadable(
            f"{escaped(str(path))}: not valid UTF-8 at byte {error.start}; save it as UTF-8"
        ) from None
