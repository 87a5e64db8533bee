# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Exact application of a single-file unified diff to bytes.

No fuzz and no offsets: every hunk must match the original at the line numbers its header
states, or the patch is refused. A pinned pre-image hash already guarantees this for shipped
patches; the strictness makes a wrong pin fail loudly instead of patching the wrong place.
"""

import re
from dataclasses import dataclass

_HUNK_HEADER = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_NO_NEWLINE = b"\\ No newline at end of file"


class PatchError(ValueError):
    """The diff is malformed or does not match the bytes it is applied to."""


@dataclass(frozen=True)
class Hunk:
    old_start: int  # 1-based first line of `old_lines`; for an empty range, the line before it
    old_lines: tuple[bytes, ...]  # lines with their line endings
    new_lines: tuple[bytes, ...]


@dataclass(frozen=True)
class FilePatch:
    old_path: str
    new_path: str
    hunks: tuple[Hunk, ...]

    def apply(self, original: bytes) -> bytes:
        lines = split_lines(original)
        result: list[bytes] = []
        cursor = 0  # index into `lines` of the first line not yet copied
        for number, hunk in enumerate(self.hunks, start=1):
            start = hunk.old_start - 1 if hunk.old_lines else hunk.old_start
            if start < cursor:
                raise PatchError(f"hunk {number} overlaps or precedes the previous hunk")
            actual = tuple(lines[start : start + len(hunk.old_lines)])
            if actual != hunk.old_lines:
                raise PatchError(
                    f"hunk {number} does not match at line {start + 1}: the file differs "
                    f"from the patch's context"
                )
            result.extend(lines[cursor:start])
            result.extend(hunk.new_lines)
            cursor = start + len(hunk.old_lines)
        result.extend(lines[cursor:])
        return b"".join(result)


def parse(diff: bytes) -> FilePatch:
    """Parse a unified diff that changes exactly one file (`a/` and `b/` prefixes are dropped)."""
    lines = split_lines(diff)
    index = 0
    while index < len(lines) and not lines[index].startswith(b"--- "):
        index += 1  # preamble such as "diff --git" and "index" lines
    if index + 1 >= len(lines) or not lines[index + 1].startswith(b"+++ "):
        raise PatchError("no '--- a/<file>' and '+++ b/<file>' header lines found")
    old_path = _header_path(lines[index])
    new_path = _header_path(lines[index + 1])
    hunks = []
    index += 2
    while index < len(lines):
        hunk, index = _parse_hunk(lines, index)
        hunks.append(hunk)
    if not hunks:
        raise PatchError("the diff has no hunks")
    return FilePatch(old_path, new_path, tuple(hunks))


def split_lines(data: bytes) -> list[bytes]:
    """Lines with their endings, split on b"\\n" only, as diff(1) and git do."""
    lines = [line + b"\n" for line in data.split(b"\n")]
    lines[-1] = lines[-1][:-1]
    if not lines[-1]:
        lines.pop()
    return lines


def _header_path(line: bytes) -> str:
    path = line[4:].rstrip(b"\r\n").split(b"\t")[0].decode("utf-8")
    for prefix in ("a/", "b/"):
        if path.startswith(prefix):
            return path[len(prefix) :]
    return path


def _parse_hunk(lines: list[bytes], index: int) -> tuple[Hunk, int]:
    header = _HUNK_HEADER.match(lines[index])
    if header is None:
        raise PatchError(
            f"line {index + 1}: expected a hunk header '@@ -a,b +c,d @@' (a patch changes "
            f"exactly one file)"
        )
    old_start = int(header[1])
    old_count = 1 if header[2] is None else int(header[2])
    new_count = 1 if header[4] is None else int(header[4])
    old_lines: list[bytes] = []
    new_lines: list[bytes] = []
    index += 1
    while index < len(lines) and (len(old_lines) < old_count or len(new_lines) < new_count):
        line = lines[index]
        tag, body = line[:1], line[1:]
        if tag not in (b" ", b"-", b"+"):
            raise PatchError(f"line {index + 1}: unexpected {line[:40]!r} inside a hunk")
        if tag in (b" ", b"-"):
            old_lines.append(body)
        if tag in (b" ", b"+"):
            new_lines.append(body)
        index += 1
        if index < len(lines) and lines[index].rstrip(b"\r\n") == _NO_NEWLINE:
            _strip_newline(old_lines if tag in (b" ", b"-") else None)
            _strip_newline(new_lines if tag in (b" ", b"+") else None)
            index += 1
    if len(old_lines) != old_count or len(new_lines) != new_count:
        raise PatchError(
            f"hunk at line {old_start} is truncated: header promises {old_count}/{new_count} "
            f"lines, found {len(old_lines)}/{len(new_lines)}"
        )
    return Hunk(old_start, tuple(old_lines), tuple(new_lines)), index


def _strip_newline(lines: list[bytes] | None) -> None:
    if lines:
        lines[-1] = lines[-1].removesuffix(b"\n")
