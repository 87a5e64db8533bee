# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Docker mode: `vllm serve` in a container of the pinned image, driven with the docker CLI on
the node (through ssh on a remote worker)."""

from __future__ import annotations

from dspark_launch.errors import LaunchError
from dspark_launch.nodes import Rank, RankState
from dspark_launch.render import NodePlan
from dspark_launch.runner import Result
from dspark_launch.shell import Shell

IMAGE_ROOT = "/opt/dspark"  # WORKDIR of docker/*.Dockerfile
IMAGE_INSTALL_PY = f"{IMAGE_ROOT}/install.py"
JIT_CACHE_VOLUME = "dspark-jit-cache"  # the same named volume as docs/docker.md's manual runs


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

    def link_python(self, env: dict[str, str]) -> list[str]:
        *run, image = self.runtime_python
        devices = ["--network", "host", "--ipc", "host", "--ulimit", "memlock=-1"]
        devices += ["--device", "/dev/infiniband"] if "NCCL_IB_HCA" in env else []
        return [*run, *devices, *(f"--env={name}={value}" for name, value in env.items()), image]

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
