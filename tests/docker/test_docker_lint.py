"""hadolint on both Dockerfiles, shellcheck on every shell script the project ships."""

import subprocess

import pytest
from dockerfiles import DOCKERFILES, REPO, require_tool

SCRIPT_DIRS = ("docker", "scripts", "launch", ".ci")


def shell_scripts() -> list:
    """Files under SCRIPT_DIRS that are shell scripts by extension or by shebang."""
    scripts = []
    for directory in SCRIPT_DIRS:
        for path in sorted((REPO / directory).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            with path.open("rb") as file:
                first_line = file.readline()
            is_shell = first_line.startswith(b"#!") and (b"sh" in first_line.split(b"/")[-1])
            if path.suffix == ".sh" or is_shell:
                scripts.append(path)
    return scripts


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
