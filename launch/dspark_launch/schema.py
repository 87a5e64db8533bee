"""Strict reading of the launcher's YAML files: every error names the file and the key.

The reference recipe's env files ran garbage when saved with a BOM or CRLF line endings, and
malformed values only crashed at run time; here the whole file is checked before anything runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from dspark_launch.errors import ConfigError

_BOM = b"\xef\xbb\xbf"


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping: PyYAML keeps the last one
    silently, so a second `api:` or `tensor_parallel_size:` would win unseen."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                first = lines.setdefault(key, line)
            except TypeError:  # an unhashable key; SafeLoader reports it below
                continue
            if first != line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice: line {first} and line {line}", None
                )
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path) -> dict[str, Any]:
    """Load a YAML mapping after checking encoding and line endings."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    if raw.startswith(_BOM):
        raise ConfigError(f"{path}: starts with a UTF-8 byte-order mark; save it without a BOM")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not valid UTF-8 at byte {e.start}; save it as UTF-8") from None
    for number, line in enumerate(text.split("\n"), start=1):
        if "\r" in line:
            raise ConfigError(
                f"{path}: line {number} has a carriage return (Windows line ending); "
                "convert the file with `dos2unix`"
            )
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}: invalid YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a YAML mapping of keys to values")
    return data


class Section:
    """Typed, consumed-once access to one mapping; `finish()` rejects keys nobody read."""

    def __init__(self, data: Mapping[str, Any], source: Path, prefix: str = "") -> None:
        self._data = data
        self._source = source
        self._prefix = prefix
        self._read: set[str] = set()

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self._source}: {self._prefix}{key}: {message}")

    def has(self, key: str) -> bool:
        return self._data.get(key) is not None

    def _get(self, key: str, required: bool) -> Any:
        self._read.add(key)
        value = self._data.get(key)
        if value is None and required:
            raise self.error(key, "required key is missing")
        return value

    def string(
        self,
        key: str,
        required: bool = True,
        default: str | None = None,
        secret: bool = False,
        argv: bool = True,
    ) -> str | None:
        """A one-line string. `secret`: errors never show the value. `argv`: the value may
        become a command-line argument, so it must not start with `-` (it would be read as an
        option: ssh `-oProxyCommand=...`, a vLLM flag in place of the model)."""
        value = self._get(key, required and default is None)
        if value is None:
            return default
        shown = "(value not shown: a secret)" if secret else f"got {value!r}"
        if not isinstance(value, str) or not value.strip():
            raise self.error(key, f"must be a non-empty string, {shown}")
        if "\n" in value or "\r" in value:
            raise self.error(key, "must be a single line")
        if argv and not secret and value.startswith("-"):
            raise self.error(
                key, f"must not start with '-' (it would be read as an option), {shown}"
            )
        return value

    def matching(
        self, key: str, pattern: str, hint: str, required: bool = True, default: str | None = None
    ) -> str | None:
        value = self.string(key, required, default)
        if value is not None and not re.fullmatch(pattern, value):
            raise self.error(key, f"{value!r} is not {hint}")
        return value

    def integer(self, key: str, minimum: int, maximum: int, default: int | None = None) -> int:
        value = self._get(key, default is None)
        if value is None:
            assert default is not None
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be an integer, got {value!r}")
        if not minimum <= value <= maximum:
            raise self.error(key, f"must be between {minimum} and {maximum}, got {value}")
        return value

    def boolean(self, key: str, default: bool | None = None) -> bool:
        value = self._get(key, default is None)
        if value is None:
            assert default is not None
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {value!r}")
        return value

    def choice(self, key: str, choices: Iterable[str], default: str | None = None) -> str:
        options = tuple(choices)
        value = self.string(key, required=default is None, default=default)
        assert value is not None
        if value not in options:
            raise self.error(key, f"must be one of {', '.join(options)}; got {value!r}")
        return value

    def string_list(self, key: str) -> list[str]:
        value = self._get(key, required=False)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(key, "must be a list of strings")
        return value

    def string_map(self, key: str) -> dict[str, str]:
        """A mapping of env-style names to string values (YAML numbers must be quoted)."""
        value = self._get(key, required=False)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.error(key, "must be a mapping of NAME: value")
        for name, item in value.items():
            if not isinstance(name, str) or not re.fullmatch(r"[A-Z_][A-Z0-9_]*", name):
                raise self.error(key, f"{name!r} is not an environment variable name")
            if not isinstance(item, str):
                raise self.error(f"{key}.{name}", f"must be a quoted string, got {item!r}")
            if "\n" in item or "\r" in item:
                raise self.error(f"{key}.{name}", "must be a single line")
        return dict(value)

    def section(self, key: str, required: bool = True) -> Section:
        value = self._get(key, required)
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise self.error(key, "must be a mapping")
        return Section(value, self._source, f"{self._prefix}{key}.")

    def exclusive(self, *keys: str) -> None:
        """At most one of `keys` may be set."""
        present = [key for key in keys if self.has(key)]
        if len(present) > 1:
            names = " and ".join(self._prefix + key for key in present)
            raise ConfigError(f"{self._source}: {names} are mutually exclusive; keep one")

    def finish(self) -> None:
        unknown = sorted(str(key) for key in self._data if key not in self._read)
        if unknown:
            raise self.error(unknown[0], "unknown key (check its spelling and indentation)")
