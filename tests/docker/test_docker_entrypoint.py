"""The image entrypoint, run for real with a recording `vllm` in place of vLLM on PATH."""

import json
import os
import signal
import subprocess
import time

import pytest
from dockerfiles import REPO

ENTRYPOINT = REPO / "docker" / "entrypoint.sh"

# Records its argv and pid, then waits for SIGTERM and reports it: stands in for `vllm`.
FAKE_VLLM = """#!/usr/bin/env python3
import json, os, signal, sys, time
from pathlib import Path
record = Path(os.environ["FAKE_VLLM_RECORD"])
def on_term(signum, frame):
    Path(str(record) + ".sigterm").write_text("received")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
record.write_text(json.dumps({"argv": sys.argv[1:], "pid": os.getpid()}))
if os.environ.get("FAKE_VLLM_WAIT"):
    time.sleep(60)
"""


@pytest.fixture
def fake_vllm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text(FAKE_VLLM)
    (bin_dir / "vllm").chmod(0o755)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_VLLM_RECORD": str(tmp_path / "record.json"),
        "DSPARK_HOST": "0.0.0.0",
        "DSPARK_PORT": "8000",
        "DSPARK_RUN_DIR": str(tmp_path / "run"),
    }
    return env, tmp_path


def run_entrypoint(env, *args):
    return subprocess.run(
        [str(ENTRYPOINT), *args], env=env, capture_output=True, text=True, timeout=30, check=False
    )


def recorded(tmp_path):
    return json.loads((tmp_path / "record.json").read_text())


def test_defaults_first_then_user_arguments_verbatim(fake_vllm):
    env, tmp_path = fake_vllm
    user_args = [
        "deepseek-ai/DeepSeek-V4-Flash-0731",
        "--speculative-config",
        '{"method": "dspark", "num_speculative_tokens": 5}',
        "--served-model-name",
        "name with spaces",
        "--api-key",
        "k1",
        "k2",
    ]
    result = run_entrypoint(env, *user_args)
    assert result.returncode == 0, result.stderr
    defaults = ["serve", "--host", "0.0.0.0", "--port", "8000"]
    assert recorded(tmp_path)["argv"] == [*defaults, *user_args]


def test_bind_address_comes_from_the_environment(fake_vllm):
    env, tmp_path = fake_vllm
    result = run_entrypoint({**env, "DSPARK_HOST": "10.0.0.7", "DSPARK_PORT": "08888"}, "model")
    assert result.returncode == 0, result.stderr
    assert recorded(tmp_path)["argv"] == ["serve", "--host", "10.0.0.7", "--port", "8888", "model"]


# Each would move vLLM's bind address away from where the health check probes.
BIND_FLAGS = [
    ["--port", "9000"],
    ["--port=9000"],
    ["--por", "9000"],
    ["--host", "10.9.9.9"],
    ["--hos=10.9.9.9"],
]


@pytest.fixture(scope="module")
def serve_parser():
    """The argument parser of the pinned vLLM's `vllm serve`."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


@pytest.mark.parametrize("flag", BIND_FLAGS, ids=" ".join)
def test_bind_flags_are_refused_with_the_fix(fake_vllm, serve_parser, flag):
    parsed = serve_parser.parse_args(["model", *flag])
    assert (parsed.host, parsed.port) != (None, 8000), "vLLM would bind elsewhere"
    env, tmp_path = fake_vllm
    result = run_entrypoint(env, "model", *flag)
    assert result.returncode == 2
    assert "DSPARK_PORT" in result.stderr and "health check" in result.stderr
    assert not (tmp_path / "record.json").exists(), "vllm must not start"


def test_vllm_parses_the_defaults_and_keeps_user_options(fake_vllm, serve_parser):
    env, tmp_path = fake_vllm
    user_args = ["my/model", "--max-num-seqs", "6", "--headless", "--nnodes", "2"]
    assert run_entrypoint({**env, "DSPARK_PORT": "8888"}, *user_args).returncode == 0
    argv = recorded(tmp_path)["argv"]
    assert argv[0] == "serve"
    parsed = serve_parser.parse_args(argv[1:])
    assert (parsed.model_tag, parsed.host, parsed.port) == ("my/model", "0.0.0.0", 8888)
    assert (parsed.max_num_seqs, parsed.headless, parsed.nnodes) == (6, True, 2)


@pytest.mark.parametrize("port", ["0", "65536", "80a", ""])
def test_bad_port_is_refused(fake_vllm, port):
    env, tmp_path = fake_vllm
    result = run_entrypoint({**env, "DSPARK_PORT": port}, "model")
    assert result.returncode != 0
    assert "DSPARK_PORT" in result.stderr
    assert not (tmp_path / "record.json").exists()


def test_no_arguments_is_a_usage_error(fake_vllm):
    env, tmp_path = fake_vllm
    result = run_entrypoint(env)
    assert result.returncode == 2
    assert "pass the model" in result.stderr
    assert not (tmp_path / "record.json").exists()


def test_headless_marker_follows_the_arguments(fake_vllm, serve_parser):
    env, tmp_path = fake_vllm
    marker = tmp_path / "run" / "headless"
    for headless in (["--headless"], ["--headl"]):
        assert serve_parser.parse_args(["model", *headless]).headless
        assert run_entrypoint(env, "model", *headless).returncode == 0
        assert marker.exists()
        assert run_entrypoint(env, "model").returncode == 0
        assert not marker.exists()


def test_exec_hands_signals_to_vllm(fake_vllm):
    """After exec, vLLM is the entrypoint's own process: SIGTERM reaches it, not a shell."""
    env, tmp_path = fake_vllm
    process = subprocess.Popen(
        [str(ENTRYPOINT), "model"], env={**env, "FAKE_VLLM_WAIT": "1"}, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "record.json").exists():
            assert time.monotonic() < deadline, "fake vllm never started"
            assert process.poll() is None, process.stderr.read()
            time.sleep(0.05)
        assert recorded(tmp_path)["pid"] == process.pid
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert (tmp_path / "record.json.sigterm").read_text() == "received"
