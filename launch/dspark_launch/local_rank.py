# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Local mode: `vllm serve` as its own process group on this host, supervised through a pid file
and /proc."""

from __future__ import annotations

import contextlib
import errno
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

from dspark_launch.errors import LaunchError
from dspark_launch.nodes import REPO_ROOT, Rank, RankState
from dspark_launch.render import NodePlan, parse_env_file
from dspark_launch.runner import Result
from dspark_launch.shell import Shell, atomic_private_write, private_dir

STOP_GRACE_S = 30


class LocalRank(Rank):
    """`vllm serve` as its own process group on this host; the pid file survives the launcher."""

    def __init__(self, shell: Shell, venv: Path) -> None:
        super().__init__(shell)
        self.venv = venv
        self.pid_path = self.node.state_dir / f"{self.node.role}.pid"
        self.log_path = self.node.state_dir / f"{self.node.role}.log"
        self.previous_log_path = self.node.state_dir / f"{self.node.role}.log.1"
        self._child: subprocess.Popen | None = None

    def install_status(self) -> Result:
        python = str(self.venv / "bin" / "python")
        return self.shell.run([python, str(REPO_ROOT / "install.py"), "--status", "--json"])

    @property
    def runtime_python(self) -> list[str]:
        return [str(self.venv / "bin" / "python")]

    @property
    def runtime_hf_home(self) -> str:
        return str(self.node.hf_home)

    @property
    def project_python(self) -> list[str]:
        return ["env", "-C", str(REPO_ROOT), *self.runtime_python]

    @property
    def vllm(self) -> Path:
        return self.venv / "bin" / "vllm"

    def _recorded(self) -> tuple[int, str] | None:
        if not private_dir(self.node.state_dir, create=False):
            return None
        try:
            pid, start_time = self.pid_path.read_text().split()
            return int(pid), start_time
        except (OSError, ValueError):
            return None

    def _alive(self, pid: int, start_time: str) -> bool:
        """Whether `pid` is still the `vllm serve` this launcher started: same start time,
        leader of its own process group, and running this venv's `vllm serve` (a pid file
        alone never decides which process group `stop` signals)."""
        if self._child is not None and self._child.pid == pid:
            return self._child.poll() is None
        proc = _proc_stat(pid)
        if proc is None or proc[1] != start_time or proc[0] == "Z" or proc[2] != pid:
            return False
        return _runs(pid, [str(self.vllm), "serve"])

    def state(self) -> RankState:
        recorded = self._recorded()
        if recorded is None:
            return RankState("absent")
        pid, start_time = recorded
        if self._alive(pid, start_time):
            return RankState("running", detail=f"pid {pid}")
        code = self._child.returncode if self._child and self._child.pid == pid else None
        return RankState("exited", detail=f"pid {pid}" + (f", exit status {code}" if code else ""))

    def start(self, plan: NodePlan) -> None:
        argv = [str(self.vllm), "serve", *plan.serve_args]
        self.shell.runner.note(
            f"start on {self.label} as a new process group, env from {self.env_path}, "
            f"output to a fresh {self.log_path} (the previous one kept as "
            f"{self.previous_log_path.name}):\n+ {shlex.join(argv)}"
        )
        if self.shell.runner.dry_run:
            return
        env = {**os.environ, **parse_env_file(self.env_path.read_text())}
        # A fresh log per start, so that waits and failures show this run's lines.
        with contextlib.suppress(FileNotFoundError):
            os.replace(self.log_path, self.previous_log_path)  # a link is moved, not followed
        log_fd = self._open_log(os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(log_fd, "ab") as log:
            self._child = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = _proc_stat(self._child.pid)
        atomic_private_write(self.pid_path, f"{self._child.pid} {proc[1] if proc else '?'}\n")

    def stop(self) -> None:
        self.shell.runner.note(
            f"stop {self.label}: SIGTERM its process group, SIGKILL after "
            f"{STOP_GRACE_S} s, then remove {self.pid_path}"
        )
        recorded = self._recorded()
        if self.shell.runner.dry_run or recorded is None:
            return
        pid, start_time = recorded
        if self._alive(pid, start_time):
            for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10)):
                _signal_group(pid, sig)
                if self._wait_group_gone(pid, wait_s):
                    break
            else:
                raise LaunchError(f"{self.label}: process group {pid} survived SIGKILL")
        self.pid_path.unlink(missing_ok=True)

    def _wait_group_gone(self, pgid: int, wait_s: float) -> bool:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pgid, os.WNOHANG)  # reap the leader if it is our child (a zombie
                # still counts as a group member); otherwise init reaps it
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.2)
        return False

    def _open_log(self, flags: int) -> int:
        """The rank's log, never through a symbolic link (the launcher may run as root)."""
        try:
            return os.open(self.log_path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise LaunchError(
                    f"{self.label}: {self.log_path} is a symbolic link; refusing to follow it "
                    "(remove it)"
                ) from None
            if e.errno == errno.ENOENT:
                raise LaunchError(f"{self.label}: no log at {self.log_path}") from None
            raise LaunchError(f"{self.label}: cannot open {self.log_path}: {e.strerror}") from None

    def logs(self, lines: int) -> str:
        if not private_dir(self.node.state_dir, create=False):
            raise LaunchError(f"{self.label}: no log at {self.log_path}")
        with os.fdopen(self._open_log(os.O_RDONLY), "rb") as log:
            text = log.read().decode(errors="replace")
        return "\n".join(_last_lines(text, lines))


def _last_lines(text: str, lines: int) -> list[str]:
    """The last `lines` lines (`lines` >= 1), split on newlines only, as `docker logs --tail`."""
    return text.removesuffix("\n").split("\n")[-lines:] if text else []


def _proc_stat(pid: int) -> tuple[str, str, int] | None:
    """(state letter, start time in clock ticks, process group) from /proc, to detect pid
    reuse."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], fields[19], int(fields[2])


def _runs(pid: int, argv: list[str]) -> bool:
    """Whether the process's command line is `argv`, directly or through the interpreter its
    shebang names (`python /venv/bin/vllm serve ...`)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    wanted = [arg.encode() for arg in argv]
    return cmdline[: len(wanted)] == wanted or cmdline[1 : 1 + len(wanted)] == wanted


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
