# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The image entrypoint, run for real with a recording `vllm` in place of vLLM on PATH."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.docker.dockerfiles import REPO
from tests.docker.launcher_args import rendered_ranks

ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
PARSE_ONLY_VLLM = REPO / "tests" / "docker" / "parse_only_vllm.py"

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


def run_entrypoint(env, *args, timeout=30):
    command = [str(ENTRYPOINT), *args]
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def recorded(tmp_path):
    return json.loads((tmp_path / "record.json").read_text())


def test_user_arguments_first_verbatim_then_the_bind_address(fake_vllm):
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
    bind = ["--host", "0.0.0.0", "--port", "8000"]
    assert recorded(tmp_path)["argv"] == ["serve", *user_args, *bind]


def test_bind_address_comes_from_the_environment(fake_vllm):
    env, tmp_path = fake_vllm
    result = run_entrypoint({**env, "DSPARK_HOST": "10.0.0.7", "DSPARK_PORT": "08888"}, "model")
    assert result.returncode == 0, result.stderr
    assert recorded(tmp_path)["argv"] == ["serve", "model", "--host", "10.0.0.7", "--port", "8888"]


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
    from dspark_launch.serving_flags import serve_parser

    return serve_parser()


@pytest.mark.parametrize("flag", BIND_FLAGS, ids=" ".join)
def test_bind_flags_are_refused_with_the_fix(fake_vllm, serve_parser, flag):
    parsed = serve_parser.parse_args(["model", *flag])
    assert (parsed.host, parsed.port) != (None, 8000), "vLLM would bind elsewhere"
    env, tmp_path = fake_vllm
    result = run_entrypoint(env, "model", *flag)
    assert result.returncode == 2
    assert "DSPARK_PORT" in result.stderr and "health check" in result.stderr
    assert not (tmp_path / "record.json").exists(), "vllm must not start"


@pytest.fixture
def parse_only_vllm(fake_vllm):
    """The entrypoint's environment with vLLM's real CLI as `vllm`, parsing instead of serving."""
    env, tmp_path = fake_vllm
    shim = tmp_path / "bin" / "vllm"
    shim.write_text(f"#!{sys.executable}\n" + PARSE_ONLY_VLLM.read_text())
    return env


def parsed_by_vllm(env, *args) -> dict:
    result = run_entrypoint(env, *args, timeout=300)  # imports vLLM's whole CLI
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("PARSED ")]
    return json.loads(line.removeprefix("PARSED "))


@pytest.mark.parametrize("role", ["head", "worker"])
def test_vllm_serve_accepts_the_launchers_arguments(parse_only_vllm, tmp_path, role):
    """What the launcher passes to each rank's container, through the entrypoint, into vLLM's own
    `vllm serve` parser. With the bind flags first, vLLM refused this list (the model must be the
    first argument when --served-model-name is given)."""
    serve_args, rank_env = rendered_ranks(tmp_path / "launch", api_port=8888)[role]
    assert "--served-model-name" in serve_args
    env = {**parse_only_vllm, **{k: v for k, v in rank_env.items() if k.startswith("DSPARK_")}}
    parsed = parsed_by_vllm(env, *serve_args)
    assert parsed["model_tag"] == serve_args[0]
    assert parsed["served_model_name"] == [serve_args[serve_args.index("--served-model-name") + 1]]
    assert (parsed["host"], parsed["port"]) == (rank_env["DSPARK_HOST"], 8888)
    assert parsed["headless"] == (role == "worker")


def test_vllm_serve_reads_a_config_file_after_the_entrypoint(parse_only_vllm, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("max-num-seqs: 6\nserved-model-name: tiny\n")
    parsed = parsed_by_vllm(parse_only_vllm, "my/model", "--config", str(config))
    assert (parsed["model_tag"], parsed["max_num_seqs"]) == ("my/model", 6)
    assert (parsed["served_model_name"], parsed["port"]) == (["tiny"], 8000)


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


@pytest.mark.parametrize(
    "yaml_text", ["port: 9000\n", "host: 10.9.9.9\n", "por: 9000\n", "'port': 1\nmax-num-seqs: 2\n"]
)
@pytest.mark.parametrize("form", ["separate", "joined"])
def test_bind_keys_in_a_config_file_are_refused(fake_vllm, serve_parser, tmp_path, yaml_text, form):
    config = tmp_path / "serve.yaml"
    config.write_text(yaml_text)
    flags = ["--config", str(config)] if form == "separate" else [f"--config={config}"]
    if form == "separate":  # the form vLLM expands (it ignores --config=FILE)
        parsed = serve_parser.parse_args(["model", *flags])
        assert (parsed.host, parsed.port) != (None, 8000), "vLLM would bind elsewhere"
    env, _ = fake_vllm
    result = run_entrypoint(env, "model", *flags)
    assert result.returncode == 2
    assert "--config" in result.stderr and "DSPARK_PORT" in result.stderr
    assert not (tmp_path / "record.json").exists(), "vllm must not start"


@pytest.mark.parametrize("yaml_text", ["[1, 2]\n", "a: [\n"])
def test_unreadable_config_file_is_a_one_line_error(fake_vllm, tmp_path, yaml_text):
    config = tmp_path / "serve.yaml"
    config.write_text(yaml_text)
    env, _ = fake_vllm
    result = run_entrypoint(env, "model", "--config", str(config))
    assert result.returncode == 2
    assert result.stderr.startswith(f"dspark entrypoint: --config {config}: ")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "record.json").exists()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested deeper than 32 levels"),
        (b"max-num-seqs: \xff\n", "not valid UTF-8 at byte 14"),
        (
            b"a: &a [x, x, x, x, x, x, x, x, x]\n"
            + b"".join(
                f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n".encode()
                for a, b in zip("abcdefgh", "bcdefghi", strict=True)
            ),
            "once its aliases are expanded",
        ),
    ],
)
def test_hostile_config_files_are_one_bounded_line(fake_vllm, tmp_path, data, message):
    """The entrypoint reads --config with the project's bounded reader (dspark_common/safe_yaml.py):
    no RecursionError or UnicodeDecodeError traceback, no hang."""
    config = tmp_path / "serve.yaml"
    config.write_bytes(data)
    env, _ = fake_vllm
    result = run_entrypoint(env, "model", "--config", str(config))
    assert result.returncode == 2
    assert result.stderr.startswith(f"dspark entrypoint: --config {config}: ")
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("host", ["", "-h", "--help", "a b", "10.0.0.1;id", "host_name", "é"])
def test_bad_bind_host_is_refused(fake_vllm, host):
    env, tmp_path = fake_vllm
    result = run_entrypoint({**env, "DSPARK_HOST": host}, "model")
    assert result.returncode != 0
    assert "DSPARK_HOST" in result.stderr
    assert not (tmp_path / "record.json").exists()


@pytest.mark.parametrize("host", ["127.0.0.1", "::", "::1", "fe80::1", "spark-a.lan", "localhost"])
def test_bind_hosts_are_accepted(fake_vllm, host):
    env, tmp_path = fake_vllm
    assert run_entrypoint({**env, "DSPARK_HOST": host}, "model").returncode == 0
    assert recorded(tmp_path)["argv"][-4:] == ["--host", host, "--port", "8000"]


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
