# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Fixtures that start real local vLLM OpenAI servers on tiny CPU models."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dspark_fixtures.checkpoints.qwen3 import build_qwen3_target
from tests.helpers import free_port

SERVER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "0",
}
STARTUP_TIMEOUT_S = 420
# The tiny tokenizer has no chat template; this one lets the chat API run.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@pytest.fixture
def unused_url() -> str:
    """A local URL with nothing listening."""
    return f"http://127.0.0.1:{free_port()}"


@dataclass
class LocalServer:
    """A `vllm` OpenAI API server in its own process group, logging to a file."""

    url: str
    process: subprocess.Popen
    log_path: Path

    @classmethod
    def start(cls, model: Path, log_path: Path, extra_args: list[str]) -> LocalServer:
        port = free_port()
        # `python -m` because the `vllm` console script of vllm-cpu looks up the
        # distribution "vllm" for --version and dies with PackageNotFoundError.
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--enforce-eager",
            *extra_args,
        ]
        with log_path.open("w") as log:
            process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **SERVER_ENV},
                start_new_session=True,
            )
        return cls(url=f"http://127.0.0.1:{port}", process=process, log_path=log_path)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"vLLM server exited early:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5):
                    return
            except OSError:
                time.sleep(2)
        pytest.fail(f"vLLM server not ready after {STARTUP_TIMEOUT_S} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """Terminate the whole process group (API server, engine core, workers)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@pytest.fixture(scope="module")
def tiny_servers(tmp_path_factory) -> Iterator[dict[str, LocalServer]]:
    """A speculative server (draft = target, k = 3, so every draft is accepted)
    and a matched plain server, both on the same tiny Qwen3 target."""
    root = tmp_path_factory.mktemp("servers")
    target = build_qwen3_target(root / "target")
    template = root / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    common = ["--chat-template", str(template)]
    spec_config = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3}
    servers: dict[str, LocalServer] = {}
    try:
        servers["spec"] = LocalServer.start(
            target,
            root / "spec.log",
            [*common, "--speculative-config", json.dumps(spec_config)],
        )
        servers["plain"] = LocalServer.start(target, root / "plain.log", common)
        for server in servers.values():
            server.wait_ready()
        yield servers
    finally:
        for server in servers.values():
            server.stop()
