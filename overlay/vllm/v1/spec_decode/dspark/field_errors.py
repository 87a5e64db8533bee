# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A speculative config that pydantic refuses, in one line naming each field and what it takes.

vLLM's front end builds ``SpeculativeConfig`` from ``--speculative-config`` (``EngineArgs``,
patched); pydantic's error lists every literal of every union member, ~56 lines for a mistyped
method, and none of them says which value was meant. A DSpark refusal raised while
``VllmConfig`` validates (``check_dspark_config``) comes out of pydantic as its own line too.
Kept free of torch and model imports.
"""

import dataclasses
import difflib
import re
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError

_INTEGER_ERRORS = ("int_parsing", "int_from_float", "int_type")


def _closest(value: object, choices: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the nearest choice, else nothing."""
    found = difflib.get_close_matches(str(value), list(choices), n=1)
    return f" Did you mean {found[0]!r}?" if found else ""


def _field_line(error: Any, fields: list[str]) -> str:
    name = ".".join(str(part) for part in error["loc"]) or "speculative_config"
    where = f"speculative_config.{name}={error['input']!r}"
    kind, message = error["type"], error["msg"]
    if kind == "literal_error":
        expected = error["ctx"]["expected"]
        closest = _closest(error["input"], re.findall(r"'([^']*)'", expected))
        return f"{where} is not accepted.{closest} Accepted: {expected}."
    if kind in _INTEGER_ERRORS:
        return f"{where} is not an integer. Write a whole number, e.g. 5."
    if kind == "unexpected_keyword_argument":
        return f"speculative_config has no field {name!r}.{_closest(name, fields)}"
    if kind == "value_error":
        return message.removeprefix("Value error, ")
    return f"{where}: {message}."


def speculative_config_error(error: ValidationError, config_class: type) -> str:
    """One line for every field pydantic refused in ``config_class`` (``SpeculativeConfig``)."""
    fields = [field.name for field in dataclasses.fields(config_class)]
    lines = dict.fromkeys(_field_line(item, fields) for item in error.errors())
    return " ".join(lines)


REFUSAL = "DSpark refused the configuration: "
"""How every DSpark refusal of a configuration begins."""


def refusal_in_one_line(error: ValidationError) -> ValueError | None:
    """The DSpark refusal that pydantic's ``error`` (from ``VllmConfig``'s validation) wraps,
    as the one-line ``ValueError`` it is; None when it wraps none."""
    for item in error.errors():
        cause = item.get("ctx", {}).get("error")
        if isinstance(cause, ValueError) and str(cause).startswith(REFUSAL):
            return ValueError(str(cause))
    return None
