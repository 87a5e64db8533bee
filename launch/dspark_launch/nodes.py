"""Node drivers: how one rank is checked, started, watched and stopped.

`LocalRank` runs `vllm serve` as a process group on this host (local mode, both ranks);
`ContainerRank` runs it in a container of the pinned image (docker mode), on the worker
through ssh. Both expose the same operations, so the launcher's logic is one code path.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from dspark_launch import gid, node_probe
from dspark_launch.errors import ConfigError, LaunchError
from dspark_launch.render import NodePlan, parse_env_file
from dspark_launch.runner import Result, Runner
from dspark_launch.site import Node

REPO_ROOT = Path(__file__).resolve().parents[2]
IMAGE_ROOT = "/opt/dspark"  # WORKDIR of docker/*.Dockerfile
IMAGE_INSTALL_PY = f"{IMAGE_ROOT}/install.py"
STOP_GRACE_S = 30
JIT_CACHE_VOLUME = "dspark-jit-cache"  # the same named volume as docs/docker.md's manual runs
SSH_UNREACHABLE = 255
# Private temp file in the target directory, then rename: readers never see a partial or
# world-readable file. Prints the sha256 the launcher compares with what it sent.
_SHIP_SCRIPT = (
    'umask 077 && mkdir -p "$(dirname "$1")" && tmp=$(mktemp "$1.XXXXXX") && '
    '{ cat >"$tmp" && chmod 600 "$tmp" && mv -f "$tmp" "$1" || { rm -f "$tmp"; exit 1; }; } && '
    'sha256sum "$1"'
)


@dataclass(frozen=True)
class RankState:
    status: str  # "running", "restarting", "exited" or "absent"
    restarts: int = 0
    detail: str = ""

    @property
    def healthy(self) -> bool:
        return self.status == "running" and self.restarts == 0

    def describe(self) -> str:
        text = self.status + (f" after {self.restarts} restart(s)" if self.restarts else "")
        return f"{text} ({self.detail})" if self.detail else text


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
        source = Path(module_file).read_text()
        argv = [*(python or [self.python]), "-", *args]
        return self.run_json(argv, source, Path(module_file).name, timeout_s)

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
            _atomic_private_write(path, text)
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


def _atomic_private_write(path: Path, text: str) -> None:
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


class Rank(ABC):
    """The operations the launcher needs from one rank."""

    def __init__(self, shell: Shell) -> None:
        self.shell = shell
        self.node = shell.node
        self.env_path = self.node.state_dir / f"{self.node.role}.env"

    @property
    def label(self) -> str:
        return self.shell.label

    @abstractmethod
    def install_status(self) -> Result:
        """`install.py --status --json` for the vLLM this rank runs."""

    def image_id(self) -> str | None:
        """The ID of the image the rank runs; None without containers."""
        return None

    @property
    @abstractmethod
    def runtime_python(self) -> list[str]:
        """How to start the Python of the serving vLLM (with the HF cache at `runtime_hf_home`),
        reading a script on stdin: what the self-test and the flag check run in."""

    @property
    @abstractmethod
    def runtime_hf_home(self) -> str:
        """The node's hf_home as `runtime_python` sees it."""

    @property
    @abstractmethod
    def project_python(self) -> list[str]:
        """`runtime_python` started in the project root (the image's, or this checkout), so
        that `-m tools.gpu_selftest` runs the project's modules with the serving vLLM."""

    @abstractmethod
    def state(self) -> RankState:
        """Whether the rank runs; "absent" when nothing of it is left."""

    @abstractmethod
    def start(self, plan: NodePlan) -> None:
        """Start the rank with the env file already shipped to `env_path`."""

    @abstractmethod
    def stop(self) -> None:
        """Stop the rank; raise LaunchError unless it is confirmed gone."""

    @abstractmethod
    def logs(self, lines: int) -> str:
        """The last `lines` lines of the rank's output."""


class LocalRank(Rank):
    """`vllm serve` as its own process group on this host; the pid file survives the launcher."""

    def __init__(self, shell: Shell, venv: Path) -> None:
        super().__init__(shell)
        self.venv = venv
        self.pid_path = self.node.state_dir / f"{self.node.role}.pid"
        self.log_path = self.node.state_dir / f"{self.node.role}.log"
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
            f"output to {self.log_path}:\n+ {shlex.join(argv)}"
        )
        if self.shell.runner.dry_run:
            return
        env = {**os.environ, **parse_env_file(self.env_path.read_text())}
        log_fd = self._open_log(os.O_WRONLY | os.O_CREAT | os.O_APPEND)
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
        _atomic_private_write(self.pid_path, f"{self._child.pid} {proc[1] if proc else '?'}\n")

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


class ContainerRank(Rank):
    """`vllm serve` in a container of the pinned image, driven with the docker CLI."""

    def __init__(self, shell: Shell, image: str) -> None:
        super().__init__(shell)
        self.image = image
        self.container = f"dspark-vllm-{self.node.role}"

    def install_status(self) -> Result:
        return self.shell.run(
            [
                "docker",
                "run",
                "--rm",
                "--entrypoint",
                "python3",
                self.image,
                IMAGE_INSTALL_PY,
                "--status",
                "--json",
            ]
        )

    @property
    def runtime_python(self) -> list[str]:
        return [
            "docker",
            "run",
            "--rm",
            "--interactive",
            "--gpus",
            "all",
            "--volume",
            f"{self.node.hf_home}:/hf:ro",
            "--entrypoint",
            "python3",
            self.image,
        ]

    @property
    def runtime_hf_home(self) -> str:
        return "/hf"

    @property
    def project_python(self) -> list[str]:
        *run, image = self.runtime_python
        return [*run, "--workdir", IMAGE_ROOT, image]

    def image_id(self) -> str | None:
        result = self.shell.run(["docker", "image", "inspect", "--format", "{{.Id}}", self.image])
        if self.shell.runner.dry_run:
            return None
        if result.rc != 0 and "no such image" in (result.stderr + result.stdout).lower():
            how = (
                "load it there (docker save IMAGE | ssh NODE docker load, see docs/docker.md)"
                if self.image.startswith("sha256:")
                else f"pull it on that node: docker pull {self.image}"
            )
            raise LaunchError(
                f"{self.label}: image {self.image} is not present ({result.last_error_line}); "
                + how
            )
        if result.rc != 0:
            raise LaunchError(
                f"{self.label}: docker cannot inspect images ({result.last_error_line}); check "
                f"that the Docker daemon runs on that node and that this user may use it"
            )
        return result.stdout.strip()

    def state(self) -> RankState:
        result = self.shell.run(
            [
                "docker",
                "inspect",
                "--format",
                "{{.State.Status}} {{.RestartCount}} {{.State.ExitCode}}",
                self.container,
            ]
        )
        if self.shell.runner.dry_run:
            return RankState("absent")
        if result.rc != 0:
            if "no such" in (result.stderr + result.stdout).lower():
                return RankState("absent")
            raise LaunchError(f"{self.label}: docker inspect failed: {result.last_error_line}")
        status, restarts, exit_code = result.stdout.split()
        detail = f"exit status {exit_code}" if status != "running" else ""
        return RankState(status, int(restarts), detail)

    def start(self, plan: NodePlan) -> None:
        argv = [
            "docker",
            "run",
            "--detach",
            "--name",
            self.container,
            "--label",
            f"io.github.dspark-vllm.role={self.node.role}",
            "--network",
            "host",
            "--ipc",
            "host",
            "--shm-size",
            "64g",
            "--ulimit",
            "memlock=-1",
            "--ulimit",
            "stack=67108864",
            "--gpus",
            "all",
            "--device",
            "/dev/infiniband",
            "--restart",
            "unless-stopped",
            "--stop-timeout",
            "10",
            "--env-file",
            str(self.env_path),
            "--volume",
            f"{self.node.hf_home}:/hf",
            "--volume",
            f"{JIT_CACHE_VOLUME}:/var/cache/dspark",
            self.image,
            *plan.serve_args,
        ]
        result = self.shell.run(argv)
        if result.rc != 0:
            raise LaunchError(f"{self.label}: docker run failed: {result.last_error_line}")

    def stop(self) -> None:
        # rm -f first: vLLM ignores SIGTERM while loading, and a grace period only delays.
        result = self.shell.run(["docker", "rm", "--force", self.container])
        if self.shell.runner.dry_run:
            return
        if result.rc != 0 and "no such" not in result.stderr.lower():
            raise LaunchError(f"{self.label}: docker rm failed: {result.last_error_line}")
        if self.state().status != "absent":
            raise LaunchError(f"{self.label}: container {self.container} is still present")

    def logs(self, lines: int) -> str:
        result = self.shell.run(["docker", "logs", "--tail", str(lines), self.container])
        if result.rc != 0 and not self.shell.runner.dry_run:
            raise LaunchError(f"{self.label}: docker logs failed: {result.last_error_line}")
        return (result.stdout + result.stderr).rstrip()
