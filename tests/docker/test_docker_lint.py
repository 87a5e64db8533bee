# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""hadolint on both Dockerfiles, shellcheck on every shell script the project ships."""

import subprocess

import pytest
from dockerfiles import DOCKERFILES, REPO, require_tool

SCRIPT_DIRS = ("docker", "scripts", "launch", ".ci")
SHELLS = {"sh", "bash", "dash", "ksh"}


def interpreter(path) -> str | None:
    """The program a `#!` line names, seen through `env`: "bash" for `#!/usr/bin/env bash`."""
    with path.open("rb") as file:
        first_line = file.readline().decode(errors="replace")
    if not first_line.startswith("#!"):
        return None
    words = first_line[2:].split()
    if words and words[0].endswith("/env"):
        words = [word for word in words[1:] if not word.startswith("-")]
    return words[0].rsplit("/", 1)[-1] if words else None


def shell_scripts() -> list:
    """Files under SCRIPT_DIRS that are shell scripts by extension or by shebang."""
    return [
        path
        for directory in SCRIPT_DIRS
        for path in sorted((REPO / directory).rglob("*"))
        if path.is_file()
        and "__pycache__" not in path.parts
        and (path.suffix == ".sh" or interpreter(path) in SHELLS)
    ]


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_hadolint_clean(name):
    hadolint = require_tool("hadolint")
    result = subprocess.run(
        [hadolint, str(DOCKERFILES[name])], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_shell_scripts_are_found():
    found = {path.relative_to(REPO).as_posix() for path in shell_scripts()}
    assert {"docker/entrypoint.sh", "docker/install-and-verify.sh"} <= found


@pytest.mark.parametrize("path", shell_scripts(), ids=lambda path: str(path.relative_to(REPO)))
def test_shellcheck_clean(path):
    shellcheck = require_tool("shellcheck")
    result = subprocess.run([shellcheck, str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("first_line", "expected"),
    [
        ("#!/usr/bin/env bash\n", "bash"),
        ("#!/bin/sh -e\n", "sh"),
        ("#!/usr/bin/env -S bash -eu\n", "bash"),
        ("#!/usr/bin/env python3\n", "python3"),
        ("import os\n", None),
    ],
)
def test_interpreter_is_read_from_the_shebang(tmp_path, first_line, expected):
    script = tmp_path / "script"
    script.write_text(first_line + "true\n")
    assert interpreter(script) == expected
