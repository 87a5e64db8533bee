# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Run external commands, or print them under --dry-run.

Every command the launcher runs goes through `Runner.run`, so `--dry-run` prints exactly the
commands a real run executes. Secrets never appear here: they travel in env files (stdin).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass
from typing import TextIO

from dspark_launch.errors import LaunchError


@dataclass(frozen=True)
class Result:
    rc: int
    stdout: str
    stderr: str

    @property
    def last_error_line(self) -> str:
        lines = (self.stderr or self.stdout).strip().splitlines()
        return lines[-1] if lines else f"exit status {self.rc}"


class Runner:
    def __init__(self, dry_run: bool = False, out: TextIO | None = None) -> None:
        self.dry_run = dry_run
        self._out = out

    def say(self, text: str) -> None:
        print(text, file=self._out or sys.stdout, flush=True)

    def note(self, text: str) -> None:
        """What a dry run would do besides running a command (writes, waits)."""
        if self.dry_run:
            self.say(f"# {text}")

    def run(
        self,
        argv: list[str],
        stdin: str | None = None,
        stdin_label: str | None = None,
        timeout_s: float = 120,
    ) -> Result:
        if self.dry_run:
            suffix = f" < {stdin_label}" if stdin_label else ""
            self.say(f"+ {shlex.join(argv)}{suffix}")
            return Result(0, "", "")
        try:
            done = subprocess.run(
                argv,
                input=stdin,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                stdin=None if stdin is not None else subprocess.DEVNULL,
            )
        except FileNotFoundError:
            raise LaunchError(f"`{argv[0]}` is not installed or not on PATH") from None
        except subprocess.TimeoutExpired:
            return Result(
                124, "", f"`{shlex.join(argv[:3])} ...` timed out after {timeout_s:.0f} s"
            )
        return Result(done.returncode, done.stdout, done.stderr)
