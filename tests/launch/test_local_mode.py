# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Local mode: both ranks as process groups on this host. First with a stand-in `vllm` for the
failure paths, then a real two-process vLLM deployment (tensor parallel 2 over --nnodes 2)."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from dspark_launch.profile import PROFILES_DIR
from tests.helpers import free_port, vllm_cli_shim
from tests.launch.launch_testlib import API_KEY, REPO, fake_snapshot, write_yaml

TINY_PROFILE = "cpu-tiny"
TINY_MODEL = "dspark-tiny/qwen3-target"
TINY_REVISION = "0123456789abcdef0123456789abcdef01234567"


def _local_site(
    tmp_path: Path, venv: Path, health_timeout_s: int, profile: str = TINY_PROFILE
) -> Path:
    node = {
        "address": "127.0.0.1",
        "hf_home": str(tmp_path / "hf"),
        "state_dir": str(tmp_path / "run"),
    }
    site = {
        "profile": profile,
        "mode": "local",
        "venv": str(venv),
        "api_bind": "127.0.0.1",
        "ports": {"api": free_port(), "master": free_port()},
        "health": {"timeout_s": health_timeout_s, "interval_s": 2},
        "head": node,
        "worker": node,
        "secrets": {"api_key": API_KEY},
    }
    return write_yaml(tmp_path / "site.yaml", site)


def _process_groups(run_dir: Path) -> list[int]:
    groups = []
    for pid_file in run_dir.glob("*.pid"):
        with contextlib.suppress(OSError, ValueError):
            groups.append(int(pid_file.read_text().split()[0]))
    return groups


def _members(pgid: int) -> list[int]:
    members = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            if int(stat_file.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                members.append(int(stat_file.parent.name))
    return members


@pytest.fixture
def reaper():
    """Kill every process group the test started, whatever happened."""
    groups: set[int] = set()
    yield groups
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def _stand_in_venv(tmp_path: Path) -> Path:
    """A venv whose `vllm` is a stand-in: the worker stays up, the head dies while loading."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    # A wrapper, not a symlink: a symlinked interpreter would lose this venv's packages, and
    # preflight runs vLLM's own flag rules and the self-test with it.
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    vllm = venv / "bin" / "vllm"
    vllm.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" --headless "*) sleep 300; exit 0 ;; esac\n'
        "echo 'loading model'; sleep 1; echo 'RuntimeError: out of memory' >&2; exit 3\n"
    )
    vllm.chmod(0o755)
    return venv


def _tiny_snapshot(hf_home: Path) -> None:
    from dspark_fixtures.checkpoints.qwen3 import build_qwen3_target

    repo = hf_home / "hub" / ("models--" + TINY_MODEL.replace("/", "--"))
    build_qwen3_target(repo / "snapshots" / TINY_REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(TINY_REVISION)


@pytest.mark.multiproc  # preflight runs vLLM's flag rules and the self-test with its Python
def test_rank_that_exits_while_loading_fails_fast_and_is_cleaned_up(tmp_path, cli, reaper):
    fake_snapshot(tmp_path / "hf", TINY_MODEL, TINY_REVISION)
    site = _local_site(tmp_path, _stand_in_venv(tmp_path), health_timeout_s=600)
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / "head.log").write_text("a line of the run before\n")

    result = cli("--site", site, "start")

    assert result.rc == 1
    assert "head rank is exited (pid" in result.err and "exit status 3" in result.err
    assert "RuntimeError: out of memory" in result.out  # the head's log tail is shown
    # Each start writes a fresh log: what it shows is this run's; the run before is kept.
    assert "the run before" not in result.out + (run_dir / "head.log").read_text()
    assert (run_dir / "head.log.1").read_text() == "a line of the run before\n"
    assert _process_groups(run_dir) == []  # both pid files removed by the cleanup stop
    worker_log = (run_dir / "worker.log").read_text()
    assert "loading model" not in worker_log  # separate logs per rank
    assert cli("--site", site, "stop").rc == 0  # nothing left: stop is a no-op


def test_stop_ignores_a_recycled_pid(tmp_path, cli, reaper):
    site = _local_site(tmp_path, _stand_in_venv(tmp_path), health_timeout_s=600)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # Our own pid with a different start time: a recycled pid must never be signalled.
    (run_dir / "head.pid").write_text(f"{os.getpid()} 1\n")
    status = cli("--site", site, "status")
    assert status.rc == 1 and f"head: exited (pid {os.getpid()})" in status.out
    assert cli("--site", site, "stop").rc == 0
    assert not (run_dir / "head.pid").exists()


def _post(url: str, body: dict, api_key: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


def _dspark_installed() -> bool:
    done = subprocess.run(
        [sys.executable, str(REPO / "install.py"), "--status", "--json"],
        capture_output=True,
        text=True,
    )
    return done.returncode == 0 and json.loads(done.stdout).get("state") == "installed"


def _dspark_profile(tmp_path: Path) -> str:
    """cpu-tiny with DSpark on: a tiny random DSpark draft beside the target."""
    from dspark_fixtures.checkpoints.qwen3 import DSparkDraftSpec, save_dspark_draft

    draft = save_dspark_draft(tmp_path / "draft", DSparkDraftSpec())
    profile = yaml.safe_load((PROFILES_DIR / f"{TINY_PROFILE}.yaml").read_text())
    profile["speculative"] = {
        "method": "dspark",
        "num_speculative_tokens": 4,
        "draft_sample_method": "greedy",
        "draft_model": str(draft),
    }
    return str(write_yaml(tmp_path / "cpu-tiny-dspark.yaml", profile))


def _spec_decode_drafts(api_port: int) -> float:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{api_port}/metrics", timeout=30) as response:
        metrics = response.read().decode()
    prefix = "vllm:spec_decode_num_drafts_total{"
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(prefix))


@pytest.mark.multiproc
def test_two_vllm_ranks_serve_through_the_head(tmp_path, cli, reaper, monkeypatch):
    """Two real `vllm serve` processes, --nnodes 2 --tensor-parallel-size 2 over gloo on
    loopback, started, used, refused a second start, and stopped through the launcher.

    They serve DSpark where install.py patched this interpreter's vLLM (as in CI), else the
    plain tiny profile: the launcher's path is the same, and one deployment is the slowest
    thing this file starts."""
    speculative = "dspark" if _dspark_installed() else "none"
    _tiny_snapshot(tmp_path / "hf")
    shim = vllm_cli_shim(tmp_path)
    if shim:
        monkeypatch.setenv(
            "PYTHONPATH", os.pathsep.join(filter(None, [shim, os.environ.get("PYTHONPATH")]))
        )
    venv = Path(sys.executable).parent.parent
    profile = _dspark_profile(tmp_path) if speculative == "dspark" else TINY_PROFILE
    site = _local_site(tmp_path, venv, health_timeout_s=600, profile=profile)
    api_port = yaml.safe_load(site.read_text())["ports"]["api"]
    run_dir = tmp_path / "run"
    try:
        started = cli("--site", site, "start")
        reaper.update(_process_groups(run_dir))
        assert started.rc == 0, started.out[-3000:] + started.err
        assert "healthy after" in started.out and "==> start worker" in started.out

        url = f"http://127.0.0.1:{api_port}/v1/completions"
        body = {"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 4, "temperature": 0}
        assert _post(url, body, api_key=None)[0] == 401  # the key from the site file is enforced
        status, answer = _post(url, body, api_key=API_KEY)
        assert status == 200 and answer["usage"]["completion_tokens"] == 4
        assert (_spec_decode_drafts(api_port) > 0) == (speculative == "dspark")

        assert cli("--site", site, "status").rc == 0
        again = cli("--site", site, "start")
        assert again.rc == 3 and "already running" in again.err

        groups = _process_groups(run_dir)
        assert len(groups) == 2 and all(_members(pgid) for pgid in groups)
        for pgid in groups:  # the API key is in no rank's command line
            for pid in _members(pgid):
                with contextlib.suppress(OSError):
                    assert API_KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        for name in ("head.env", "worker.env"):
            assert stat.S_IMODE((run_dir / name).stat().st_mode) == 0o600
        assert API_KEY in (run_dir / "head.env").read_text()
        assert API_KEY not in (run_dir / "worker.env").read_text()
        for log in run_dir.glob("*.log"):
            assert API_KEY not in log.read_text(errors="replace")
            assert stat.S_IMODE(log.stat().st_mode) == 0o600

        stopped = cli("--site", site, "stop")
        assert stopped.rc == 0, stopped.err
        assert [pid for pgid in groups for pid in _members(pgid)] == []
        assert cli("--site", site, "stop").rc == 0
        assert cli("--site", site, "status").rc == 1
    finally:
        reaper.update(_process_groups(run_dir))
