# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""How the launcher runs commands on a node and ships files to it: directly on the head, through
ssh on a remote worker; and the private state directory those files live in."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import stat
import sys
import tempfile
from pathlib import Path

from dspark_common import operator_input, vllm_flags
from dspark_launch import gid, node_probe
from dspark_launch.errors import ConfigError, LaunchError
from dspark_launch.runner import Result, Runner
from dspark_launch.site import Node

SSH_UNREACHABLE = 255
# Private temp file in the target directory, then rename: readers never see a partial or
# world-readable file. Prints the sha256 the launcher compares with what it sent.
_SHIP_SCRIPT = (
    'umask 077 && mkdir -p "$(dirname "$1")" && tmp=$(mktemp "$1.XXXXXX") && '
    '{ cat >"$tmp" && chmod 600 "$tmp" && mv -f "$tmp" "$1" || { rm -f "$tmp"; exit 1; }; } && '
    'sha256sum "$1"'
)
# Project modules the scripts run on a node import (stdlib only), shipped with each script.
SHIPPED_MODULES = {
    "dspark_common.operator_input": Path(operator_input.__file__),
    "dspark_common.vllm_flags": Path(vllm_flags.__file__),
}


def bundled(script: Path) -> str:
    """`script` as one program for `python3 -`, the modules it may import registered first: the
    node has the script's text only (the head's Python and an image's may lack the project)."""
    modules = {name: path.read_text() for name, path in SHIPPED_MODULES.items()}
    return (
        "import sys as _sys, types as _types\n"
        f"for _name, _source in {modules!r}.items():\n"
        "    _module = _sys.modules[_name] = _types.ModuleType(_name)\n"
        "    exec(compile(_source, _name.replace('.', '/') + '.py', 'exec'), _module.__dict__)\n"
        "del _sys, _types, _name, _source, _module\n"
        f"exec(compile({script.read_text()!r}, {script.name!r}, 'exec'))\n"
    )


class Shell:
    """Runs a node's commands: directly on the head, through ssh on a remote worker."""

    def __init__(self, runner: Runner, node: Node) -> None:
        self.runner = runner
        self.node = node
        self.label = f"{node.role} ({node.ssh})" if node.ssh else node.role

    @property
    def python(self) -> str:
        return "python3" if self.node.ssh else sys.executable

    def run(
        self,
        argv: list[str],
        stdin: str | None = None,
        stdin_label: str | None = None,
        timeout_s: float = 120,
    ) -> Result:
        if self.node.ssh:
            # The host after `--`, so that no value can ever be read as an ssh option.
            ssh = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "--", self.node.ssh]
            argv = [*ssh, shlex.join(argv)]
        result = self.runner.run(argv, stdin=stdin, stdin_label=stdin_label, timeout_s=timeout_s)
        if self.node.ssh and result.rc == SSH_UNREACHABLE:
            raise LaunchError(
                f"{self.label}: unreachable over ssh: {result.last_error_line} "
                "(check the host is up and `ssh -o BatchMode=yes` works without a password)"
            )
        return result

    def run_script(
        self,
        module_file: str | Path,
        args: list[str],
        python: list[str] | None = None,
        timeout_s: float = 120,
    ) -> dict:
        """Run a single-file script on the node (the stdlib-only probes with the node's Python,
        or with `python`, e.g. the image's); return its JSON answer, its last stdout line."""
        argv = [*(python or [self.python]), "-", *args]
        return self.run_json(argv, bundled(Path(module_file)), Path(module_file).name, timeout_s)

    def run_json(
        self,
        argv: list[str],
        stdin: str | None = None,
        stdin_label: str | None = None,
        timeout_s: float = 120,
    ) -> dict:
        """Run a command that answers with one JSON object, its last stdout line."""
        result = self.run(argv, stdin, stdin_label, timeout_s)
        if self.runner.dry_run:
            return {}
        lines = result.stdout.strip().splitlines()
        try:
            return json.loads(lines[-1] if lines else "")
        except json.JSONDecodeError:
            raise LaunchError(f"{self.label}: probe failed: {result.last_error_line}") from None

    def write_private(self, path: Path, text: str, shown: str) -> None:
        """Atomically replace `path` with `text`, mode 0600, then verify its hash on the node."""
        self.runner.note(f"write {path} on {self.label} (mode 0600, atomic):\n{shown.rstrip()}")
        if self.node.ssh:
            result = self.run(["sh", "-c", _SHIP_SCRIPT, "sh", str(path)], text, "env file")
            written = result.stdout.split()[0] if result.stdout.strip() else ""
        else:
            if self.runner.dry_run:
                return
            atomic_private_write(path, text)
            written = hashlib.sha256(path.read_bytes()).hexdigest()
        if not self.runner.dry_run and written != hashlib.sha256(text.encode()).hexdigest():
            raise LaunchError(f"{self.label}: {path} did not arrive intact (sha256 mismatch)")

    def gid_index(self) -> str:
        answer = self.run_script(gid.__file__, [self.node.nccl_ib_hca or "", self.node.address])
        if self.runner.dry_run:
            return ""
        if "gid_index" not in answer:
            raise LaunchError(f"{self.label}: NCCL_IB_GID_INDEX: {answer.get('error')}")
        return str(answer["gid_index"])

    def probe(self, check: str, args: list[str]) -> None:
        answer = self.run_script(node_probe.__file__, [check, *args])
        if not self.runner.dry_run and not answer.get("ok"):
            raise LaunchError(f"{self.label}: {check}: {answer.get('detail')}")


def private_dir(path: Path, create: bool) -> bool:
    """Check (and with `create`, make, mode 0700) a state directory: it holds env files with
    secrets, pid files `stop` signals and logs vLLM appends to, so it must be a real directory
    owned by this user that no one else can write. Returns whether it exists."""
    try:
        if create:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.lstat()
    except FileNotFoundError:
        return False
    except FileExistsError:
        info = path.lstat()
    except OSError as e:
        raise ConfigError(
            f"state_dir {path}: cannot create it ({e.strerror}); create it as the user who "
            f"runs the launcher (mkdir -m 700 {path}) or name another state_dir"
        ) from None
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"state_dir {path}: exists and is not a directory; name another one")
    if info.st_uid != os.getuid():
        raise ConfigError(
            f"state_dir {path}: owned by uid {info.st_uid}, not by you (uid {os.getuid()}); "
            "name a directory of your own"
        )
    if info.st_mode & 0o022:
        raise ConfigError(
            f"state_dir {path}: writable by others (mode {stat.S_IMODE(info.st_mode):o}); "
            f"chmod 700 {path}"
        )
    return True


def atomic_private_write(path: Path, text: str) -> None:
    private_dir(path.parent, create=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
