# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""One bounded YAML reader for every config file the project reads: the launcher's site file and
profiles, the image entrypoint's `--config` check and `recipe/pins.yaml`.

PyYAML alone loads an alias bomb into a small shared graph that hangs whatever walks or prints
it, recurses until `RecursionError` on deep nesting, keeps the last of two equal keys and raises
`UnicodeDecodeError` on bytes that are not UTF-8. This reader refuses all of these with a
one-line `YamlError` naming the file, and every message it raises quotes the file through
`operator_input.shown` or `escaped` (one line, cut); a path that is not a regular file, or a file
larger than `MAX_BYTES`, is refused by `operator_input.read_regular` before anything is parsed.
Standard library and PyYAML only: the installer, the launcher and the image's entrypoint all
import it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from dspark_common.operator_input import NotReadable, escaped, read_regular, shown

MAX_BYTES = 1 << 20
"""Largest config file read (the shipped ones are a few KiB)."""
MAX_DEPTH = 32
"""Deepest nesting of mappings and lists (the shipped files nest 4 deep)."""
MAX_NODES = 100_000
"""Most values the document may hold with every alias expanded (an alias bomb holds 10^9)."""
_BOM = b"\xef\xbb\xbf"


class YamlError(ValueError):
    """The file cannot be read as a bounded YAML mapping; the message names the file."""


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader with bounded nesting, refusing a key given twice in one mapping (PyYAML keeps
    the last one silently, so a second `api:` would win unseen)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise yaml.composer.ComposerError(
                None,
                None,
                f"nested deeper than {MAX_DEPTH} levels",
                self.peek_event().start_mark,
            )
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                first = lines.get(key)
            except TypeError:  # an unhashable key; SafeLoader reports it below
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {shown(key)} appears twice: line {first} and line {line}"
                )
            lines[key] = line
        return super().construct_mapping(node, deep=deep)


def load_mapping(path: Path) -> dict[str, Any]:
    """The YAML mapping in `path`; `YamlError` for anything else."""
    try:
        raw = read_regular(path, MAX_BYTES).data
    except NotReadable as error:
        raise YamlError(str(error)) from None
    name = escaped(str(path))
    if raw.startswith(_BOM):
        raise YamlError(f"{name}: starts with a UTF-8 byte-order mark; save it without a BOM")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise YamlError(
            f"{name}: not valid UTF-8 at byte {error.start}; save it as UTF-8"
        ) from None
    for number, line in enumerate(text.split("\n"), start=1):
        if "\r" in line:
            raise YamlError(
                f"{name}: line {number} has a carriage return (Windows line ending); "
                "convert the file with `dos2unix`"
            )
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _expanded_size(node, 1, {}, set())
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(error, "problem", None) or "unreadable"
        raise YamlError(f"{name}: invalid YAML{where}: {escaped(problem, 200)}") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise YamlError(f"{name}: must be a YAML mapping of keys to values, not {_kind(data)}")
    return data


def _expanded_size(node: yaml.Node, depth: int, sizes: dict[int, int], open_: set[int]) -> int:
    """How many values `node` holds once every alias is expanded; raise beyond the bounds.
    Aliases share nodes, so each node is counted once and its size reused."""
    if depth > MAX_DEPTH:
        raise yaml.composer.ComposerError(
            None, None, f"nested deeper than {MAX_DEPTH} levels (aliases expanded)", node.start_mark
        )
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        raise yaml.composer.ComposerError(
            None, None, "an alias refers to a value that contains it", node.start_mark
        )
    open_.add(key)
    children: list[yaml.Node] = []
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [item for pair in node.value for item in pair]
    size = 1 + sum(_expanded_size(child, depth + 1, sizes, open_) for child in children)
    open_.discard(key)
    if size > MAX_NODES:
        raise yaml.composer.ComposerError(
            None,
            None,
            f"holds more than {MAX_NODES} values once its aliases are expanded (an alias bomb?)",
            node.start_mark,
        )
    sizes[key] = size
    return size


def _kind(data: object) -> str:
    return "an empty file" if data is None else f"a {type(data).__name__}"
