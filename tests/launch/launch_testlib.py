# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Helpers for the launcher tests: site/profile writers, the CLI runner, recording fakes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "launch"))

from dspark_launch.cli import main  # noqa: E402
from tests.helpers import free_port  # noqa: E402

FAKES = Path(__file__).parent / "fakes"
API_KEY = "sk-test-SECRET-4f9c"
HF_TOKEN = "hf_test_SECRET_77aa"
FAKE_REVISION = "a" * 40
FAKE_IMAGE = "registry.example/dspark-vllm@sha256:" + "b" * 64


def write_yaml(path: Path, data: dict, mode: int = 0o600) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    path.chmod(mode)
    return path


@dataclass
class Outcome:
    rc: int
    out: str
    err: str


@pytest.fixture
def cli(capsys) -> Callable[..., Outcome]:
    """Run `dspark-launch ARGS...` in-process; returns exit status and captured output."""

    def run(*args: str) -> Outcome:
        rc = main([str(arg) for arg in args])
        captured = capsys.readouterr()
        return Outcome(int(rc), captured.out, captured.err)

    return run


def fake_snapshot(hf_home: Path, model: str, revision: str) -> None:
    snapshot = hf_home / "hub" / ("models--" + model.replace("/", "--")) / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(b"\0")


def write_profile(path: Path, **overrides) -> Path:
    """A docker-mode profile without RoCE, so the recording fakes can play both nodes."""
    profile = {
        "model": "org/fake-model",
        "revision": FAKE_REVISION,
        "served_model_name": "fake",
        "tensor_parallel_size": 2,
        "max_num_seqs": 4,
        "max_model_len": 1024,
        "cuda_graphs": True,
        "speculative": {"method": "none"},
        "nccl_roce": False,
        **overrides,
    }
    return write_yaml(path, profile, mode=0o644)


@dataclass
class FakeCluster:
    """Two docker "nodes" played by recording fakes of docker and ssh on PATH."""

    root: Path
    site: Path
    api_port: int

    @property
    def log(self) -> Path:
        return self.root / "commands.log"

    def commands(self) -> list[dict]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def scenario(self, **nodes: dict) -> None:
        data = {
            "head": {"image_id": "sha256:img1", "serve_port": self.api_port},
            "worker": {"image_id": "sha256:img1"},
        }
        for node, settings in nodes.items():
            data[node] = {**data[node], **settings}
        (self.root / "scenario.json").write_text(json.dumps(data))

    def container(self, node: str, status: str = "running", restarts: int = 0) -> None:
        path = self.root / "containers" / node / f"dspark-vllm-{node}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"status": status, "restarts": restarts, "exit_code": 0}))

    def containers(self) -> dict[str, dict]:
        return {
            path.parent.name: json.loads(path.read_text())
            for path in (self.root / "containers").glob("*/*.json")
        }

    def docker_runs(self) -> list[str]:
        """Nodes on which a rank was started, in order."""
        return [
            entry["node"]
            for entry in self.commands()
            if entry["argv"][:2] == ["docker", "run"] and "--detach" in entry["argv"]
        ]


@pytest.fixture
def fake_cluster(tmp_path, monkeypatch) -> FakeCluster:
    root = tmp_path / "fake"
    root.mkdir()
    monkeypatch.setenv("PATH", f"{FAKES}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DIR", str(root))
    monkeypatch.setenv("FAKE_LOG", str(root / "commands.log"))
    for node in ("head", "worker"):
        fake_snapshot(tmp_path / node / "hf", "org/fake-model", FAKE_REVISION)
    api_port = free_port()
    profile = write_profile(tmp_path / "fake-profile.yaml")
    site = {
        "profile": str(profile),
        "mode": "docker",
        "image": FAKE_IMAGE,
        "api_bind": "127.0.0.1",
        "ports": {"api": api_port, "master": free_port()},
        "health": {"timeout_s": 30, "interval_s": 1},
        "head": {
            "address": "127.0.0.1",
            "hf_home": str(tmp_path / "head" / "hf"),
            "state_dir": str(tmp_path / "head" / "state"),
        },
        "worker": {
            "ssh": "dgx@spark-b",
            "address": "127.0.0.2",
            "hf_home": str(tmp_path / "worker" / "hf"),
            "state_dir": str(tmp_path / "worker" / "state"),
        },
        "secrets": {"api_key": API_KEY, "hf_token": HF_TOKEN},
    }
    cluster = FakeCluster(root, write_yaml(tmp_path / "site.yaml", site), api_port)
    cluster.scenario()
    yield cluster
    for state in cluster.containers().values():  # API stand-ins a failed test left behind
        if state.get("pid"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(state["pid"], signal.SIGKILL)
