# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Node drivers: how one rank is checked, started, watched and stopped.

`Rank` is what the launcher needs from one rank, whatever runs it: `LocalRank`
(`local_rank.py`) runs `vllm serve` as a process group on this host (local mode, both ranks);
`ContainerRank` (`container_rank.py`) runs it in a container of the pinned image (docker mode).
Either reaches its node through a `Shell` (`shell.py`): directly on the head, through ssh on a
remote worker. So the launcher's logic is one code path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from dspark_launch.render import NodePlan
from dspark_launch.runner import Result
from dspark_launch.shell import Shell

REPO_ROOT = Path(__file__).resolve().parents[2]


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

    def link_python(self, env: dict[str, str]) -> list[str]:
        """`runtime_python` with the serving rank's `env` (no secrets), network and devices:
        what the two-node link check runs in."""
        return ["env", *(f"{name}={value}" for name, value in env.items()), *self.runtime_python]

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
