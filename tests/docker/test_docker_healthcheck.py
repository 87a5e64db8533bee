# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The image's health check, run against a real local HTTP server standing in for vLLM."""

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.docker.dockerfiles import REPO

HEALTHCHECK = REPO / "docker" / "healthcheck.py"
sys.path.insert(0, str(HEALTHCHECK.parent))
from healthcheck import health_url  # noqa: E402


class FakeVllm(BaseHTTPRequestHandler):
    """Answers /health with the server's configured status, anything else with 404."""

    def do_GET(self):
        status = self.server.health_status if self.path == "/health" else 404
        self.send_response(status)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeVllm)
    httpd.health_status = 200
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def run_healthcheck(tmp_path, port, host="0.0.0.0"):
    env = {"DSPARK_HOST": host, "DSPARK_PORT": str(port), "DSPARK_RUN_DIR": str(tmp_path)}
    # A proxy in the environment must not capture the local probe.
    env["http_proxy"] = env["HTTP_PROXY"] = "http://127.0.0.1:9"
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK)], env=env, capture_output=True, text=True, timeout=30
    )


def test_healthy_when_health_answers_200(server, tmp_path):
    result = run_healthcheck(tmp_path, server.server_address[1])
    assert result.returncode == 0, result.stderr


def test_unhealthy_when_health_answers_an_error(server, tmp_path):
    server.health_status = 503
    result = run_healthcheck(tmp_path, server.server_address[1])
    assert result.returncode == 1
    assert "/health: HTTP 503" in result.stderr


def test_unhealthy_when_nothing_listens(tmp_path, server):
    port = server.server_address[1]
    server.shutdown()
    server.server_close()
    result = run_healthcheck(tmp_path, port)
    assert result.returncode == 1
    assert f"http://127.0.0.1:{port}/health" in result.stderr


def test_headless_worker_is_healthy_without_a_server(tmp_path):
    (tmp_path / "headless").touch()
    assert run_healthcheck(tmp_path, 1).returncode == 0
    (tmp_path / "headless").unlink()
    assert run_healthcheck(tmp_path, 1).returncode == 1


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("0.0.0.0", "http://127.0.0.1:8000/health"),
        ("::", "http://[::1]:8000/health"),
        ("10.1.2.3", "http://10.1.2.3:8000/health"),
        ("fd00::5", "http://[fd00::5]:8000/health"),
    ],
)
def test_probe_targets_the_bind_address(host, url):
    assert health_url({"DSPARK_HOST": host, "DSPARK_PORT": "8000"}) == url
