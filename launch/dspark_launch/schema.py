# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Strict reading of the launcher's YAML files: every error names the file and the key.

An env file saved with a BOM or CRLF line endings runs garbage in a shell, and a malformed
value crashes only at run time; here the whole file is checked before anything runs.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dspark_common.operator_input import MAX_SHOWN, escaped, shown
from dspark_common.safe_yaml import YamlError, load_mapping
from dspark_launch.errors import ConfigError

LINE_BREAKS = frozenset("\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029")
"""Every character `str.splitlines()` splits on. A value holding one would read back as two
lines from an env file parsed in Python, but as one value by `docker --env-file`."""


def is_one_line(value: str) -> bool:
    """No line break of any kind, and no NUL (which no env var or argv can carry)."""
    return "\0" not in value and LINE_BREAKS.isdisjoint(value)


def read_yaml(path: Path) -> dict[str, Any]:
    """Load a YAML mapping with the project's bounded reader (encoding, line endings, aliases,
    nesting, size and duplicate keys checked)."""
    try:
        return load_mapping(path)
    except YamlError as error:
        raise ConfigError(str(error)) from None


class Section:
    """Typed, consumed-once access to one mapping; `finish()` rejects keys nobody read."""

    def __init__(self, data: Mapping[str, Any], source: Path, prefix: str = "") -> None:
        self._data = data
        self._source = source
        self._prefix = prefix
        self._read: set[str] = set()

    def error(self, key: str, message: str) -> ConfigError:
        """`key` may come from the file (an unknown key): it is shown escaped."""
        where = f"{escaped(str(self._source))}: {self._prefix}{escaped(key, MAX_SHOWN)}"
        return ConfigError(f"{where}: {message}")

    def has(self, key: str) -> bool:
        return self._data.get(key) is not None

    def _get(self, key: str, required: bool) -> Any:
        self._read.add(key)
        value = self._data.get(key)
        if value is None and required:
            raise self.error(key, "required key is missing" + self._misspelled(key))
        return value

    def _misspelled(self, key: str) -> str:
        """The file's key closest to a missing ``key``, which it may be a misspelling of."""
        others = [str(other) for other in self._data if other != key]
        close = difflib.get_close_matches(key, others, n=1, cutoff=0.75)
        return f" (the file has {shown(close[0])}: a misspelling of {key}?)" if close else ""

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
        quoted = "(value not shown: a secret)" if secret else f"got {shown(value)}"
        if not isinstance(value, str) or not value.strip():
            raise self.error(key, f"must be a non-empty string, {quoted}")
        if not is_one_line(value):
            raise self.error(key, "must be a single line (no line or page breaks, no NUL)")
        if not value.isprintable():
            raise self.error(
                key, f"must hold printable characters only (no tabs or escape sequences), {quoted}"
            )
        if argv and not secret and value.startswith("-"):
            raise self.error(
                key, f"must not start with '-' (it would be read as an option), {quoted}"
            )
        return value

    def matching(
        self, key: str, pattern: str, hint: str, required: bool = True, default: str | None = None
    ) -> str | None:
        value = self.string(key, required, default)
        if value is not None and not re.fullmatch(pattern, value):
            raise self.error(key, f"{shown(value)} is not {hint}")
        return value

    def integer(self, key: str, minimum: int, maximum: int, default: int | None = None) -> int:
        value = self._get(key, default is None)
        if value is None:
            assert default is not None
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be an integer, got {shown(value)}")
        if not minimum <= value <= maximum:
            raise self.error(key, f"must be between {minimum} and {maximum}, got {value}")
        return value

    def boolean(self, key: str, default: bool | None = None) -> bool:
        value = self._get(key, default is None)
        if value is None:
            assert default is not None
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {shown(value)}")
        return value

    def choice(self, key: str, choices: Iterable[str], default: str | None = None) -> str:
        options = tuple(choices)
        value = self.string(key, required=default is None, default=default)
        assert value is not None
        if value not in options:
            raise self.error(key, f"must be one of {', '.join(options)}; got {shown(value)}")
        return value

    def string_list(self, key: str) -> list[str]:
        value = self._get(key, required=False)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(key, "must be a list of strings")
        for item in value:
            if not is_one_line(item) or not item.isprintable():
                raise self.error(
                    key, f"{shown(item)} must be one line of printable characters (no escapes)"
                )
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
                raise self.error(key, f"{shown(name)} is not an environment variable name")
            if not isinstance(item, str):
                raise self.error(f"{key}.{name}", f"must be a quoted string, got {shown(item)}")
            if not is_one_line(item):
                raise self.error(
                    f"{key}.{name}", "must be a single line (no line or page breaks, no NUL)"
                )
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
            raise ConfigError(
                f"{escaped(str(self._source))}: {names} are mutually exclusive; keep one"
            )

    def finish(self) -> None:
        unknown = sorted(str(key) for key in self._data if key not in self._read)
        if unknown:
            raise self.error(unknown[0], "unknown key (check its spelling and indentation)")
