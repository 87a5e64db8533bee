# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Ordering, failure handling and exit codes in docker mode, with docker and ssh replaced by
recording fakes on PATH (the fake ssh runs the worker's commands locally)."""

from __future__ import annotations

import stat
from pathlib import Path

import yaml

from tests.launch.launch_testlib import API_KEY, HF_TOKEN, FakeCluster, write_profile, write_yaml


def _all_argv_text(cluster: FakeCluster) -> str:
    return "\n".join(" ".join(entry["argv"]) for entry in cluster.commands())


def _set_profile(cluster: FakeCluster, **overrides) -> None:
    site = yaml.safe_load(cluster.site.read_text())
    write_profile(Path(site["profile"]), **overrides)


def test_start_checks_ships_starts_worker_first_and_completes(fake_cluster, cli):
    result = cli("--site", fake_cluster.site, "start")

    assert result.rc == 0, result.err
    assert fake_cluster.docker_runs() == ["worker", "head"]
    argvs = [entry["argv"] for entry in fake_cluster.commands()]
    first_run = next(i for i, argv in enumerate(argvs) if "--detach" in argv)
    checks = [" ".join(argv) for argv in argvs[:first_run]]
    assert any("image inspect" in c for c in checks)
    assert any("--status --json" in c for c in checks)
    assert any("snapshot" in c for c in checks)  # the worker's snapshot probe, through ssh
    assert any("sha256sum" in c for c in checks)  # env file shipped before any rank starts
    worker_env = Path(yaml.safe_load(fake_cluster.site.read_text())["worker"]["state_dir"])
    env_file = worker_env / "worker.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert f"HF_TOKEN={HF_TOKEN}" in env_file.read_text()
    assert "VLLM_API_KEY" not in env_file.read_text()  # the headless worker serves no API
    assert "--headless" in argvs[first_run][-1]  # worker's docker run is the ssh command string
    requests = (fake_cluster.root / "api-requests.log").read_text()
    assert f"POST /v1/completions Bearer {API_KEY}" in requests
    assert "ok: ' hi'" in result.out
    everything = _all_argv_text(fake_cluster) + result.out + result.err
    assert API_KEY not in everything and HF_TOKEN not in everything


def test_head_first_order_is_a_profile_setting(fake_cluster, cli):
    _set_profile(fake_cluster, start_order="head-first")
    assert cli("--site", fake_cluster.site, "start").rc == 0
    assert fake_cluster.docker_runs() == ["head", "worker"]


def test_start_when_both_ranks_run_exits_3_and_starts_nothing(fake_cluster, cli):
    fake_cluster.container("head")
    fake_cluster.container("worker")
    result = cli("--site", fake_cluster.site, "start")
    assert result.rc == 3
    assert "already running" in result.err
    assert fake_cluster.docker_runs() == []


def test_stale_worker_is_a_failure_not_already_running(fake_cluster, cli):
    fake_cluster.container("worker")
    result = cli("--site", fake_cluster.site, "start")
    assert result.rc == 1
    assert "stale rank(s) found: worker running" in result.err
    assert "dspark-launch stop" in result.err
    assert fake_cluster.docker_runs() == []


def test_different_image_ids_fail_preflight(fake_cluster, cli):
    fake_cluster.scenario(worker={"image_id": "sha256:img2"})
    result = cli("--site", fake_cluster.site, "start")
    assert result.rc == 1
    assert "image IDs differ: head sha256:img1, worker sha256:img2" in result.err
    assert fake_cluster.docker_runs() == []


def test_missing_image_on_worker_names_the_fix(fake_cluster, cli):
    fake_cluster.scenario(worker={"image_id": None})
    result = cli("--site", fake_cluster.site, "preflight")
    assert result.rc == 1
    assert "worker (dgx@spark-b): image" in result.err and "docker pull" in result.err


def test_different_install_digests_fail_preflight(fake_cluster, cli):
    fake_cluster.scenario(worker={"install": {"state": "installed", "digest": "d2"}})
    result = cli("--site", fake_cluster.site, "preflight")
    assert result.rc == 1
    assert "install.py --status digests differ: head d1, worker d2" in result.err


def test_dspark_profile_requires_the_installed_patch(fake_cluster, cli):
    _set_profile(fake_cluster, speculative={"method": "dspark", "num_speculative_tokens": 3})
    fake_cluster.scenario(head={"install": {"state": "not-installed", "digest": "d0"}})
    result = cli("--site", fake_cluster.site, "start")
    assert result.rc == 1
    assert "head: the DSpark patch is not-installed; run install.py" in result.err
    assert fake_cluster.docker_runs() == []


def test_without_dspark_an_unpatched_vllm_is_only_noted(fake_cluster, cli):
    fake_cluster.scenario(
        head={"install": {"state": "not-installed", "digest": "d0"}},
        worker={"install": {"state": "not-installed", "digest": "d0"}},
    )
    result = cli("--site", fake_cluster.site, "preflight")
    assert result.rc == 0, result.err
    assert "note: head: the DSpark patch is not-installed" in result.out


def test_missing_shard_on_worker_fails_preflight(fake_cluster, cli, tmp_path):
    for shard in (tmp_path / "worker" / "hf").rglob("model.safetensors"):
        shard.unlink()
    result = cli("--site", fake_cluster.site, "preflight")
    assert result.rc == 1
    assert "worker (dgx@spark-b): snapshot:" in result.err
    assert "no *.safetensors" in result.err


def test_unreachable_worker_fails_preflight_and_stop(fake_cluster, cli):
    (fake_cluster.root / "unreachable").touch()
    result = cli("--site", fake_cluster.site, "preflight")
    assert result.rc == 1
    assert "worker (dgx@spark-b): unreachable over ssh: ssh: connect to host" in result.err

    fake_cluster.container("head")
    result = cli("--site", fake_cluster.site, "stop")
    assert result.rc == 1
    assert "stop incomplete" in result.err and "unreachable" in result.err
    assert "head" not in fake_cluster.containers()  # the reachable head was still stopped


def test_crash_looping_head_fails_fast_and_stops_both(fake_cluster, cli):
    fake_cluster.scenario(
        head={"after_start": {"status": "restarting", "restarts": 3, "exit_code": 1}}
    )
    result = cli("--site", fake_cluster.site, "start")
    assert result.rc == 1
    assert "head rank is restarting after 3 restart(s)" in result.err
    assert "not healthy after" not in result.err  # caught by the state watch, not the timeout
    assert "fake log line from head" in result.out  # both ranks' logs are shown
    assert fake_cluster.containers() == {}  # and both ranks are removed


def test_exited_worker_fails_fast(fake_cluster, cli):
    fake_cluster.scenario(
        worker={"after_start": {"status": "exited", "restarts": 0, "exit_code": 1}}
    )
    result = cli("--site", fake_cluster.site, "start")
    assert result.rc == 1
    assert "worker (dgx@spark-b) rank is exited (exit status 1)" in result.err


def test_health_timeout_fails_with_the_reason(fake_cluster, cli):
    site = yaml.safe_load(fake_cluster.site.read_text())
    site["health"] = {"timeout_s": 1, "interval_s": 1}
    write_yaml(fake_cluster.site, site)
    fake_cluster.scenario(head={"serve_port": None})  # a head that never answers
    scenario = fake_cluster.root / "scenario.json"
    scenario.write_text(scenario.read_text().replace('"serve_port": null, ', ""))
    result = cli("--site", fake_cluster.site, "start")
    assert result.rc == 1
    assert "not healthy after" in result.err and "/health" in result.err


def test_stop_is_idempotent(fake_cluster, cli):
    fake_cluster.container("head")
    fake_cluster.container("worker")
    assert cli("--site", fake_cluster.site, "stop").rc == 0
    assert fake_cluster.containers() == {}
    again = cli("--site", fake_cluster.site, "stop")
    assert again.rc == 0, again.err


def test_stop_fails_when_a_container_cannot_be_removed(fake_cluster, cli):
    fake_cluster.container("worker")
    fake_cluster.scenario(worker={"rm_fails": True})
    result = cli("--site", fake_cluster.site, "stop")
    assert result.rc == 1
    assert "worker (dgx@spark-b): docker rm failed" in result.err


def test_status_reports_each_rank_and_fails_unless_healthy(fake_cluster, cli):
    fake_cluster.container("head")
    result = cli("--site", fake_cluster.site, "status")
    assert result.rc == 1
    assert "head: running" in result.out and "worker (dgx@spark-b): absent" in result.out


def test_logs_reads_both_ranks(fake_cluster, cli):
    result = cli("--site", fake_cluster.site, "logs", "-n", "5")
    assert result.rc == 0
    assert "fake log line from head" in result.out and "fake log line from worker" in result.out
    assert ["docker", "logs", "--tail", "5", "dspark-vllm-head"] in [
        entry["argv"] for entry in fake_cluster.commands()
    ]


def test_no_usable_gid_fails_before_any_rank_starts(fake_cluster, cli):
    _set_profile(fake_cluster, nccl_roce=True)
    site = yaml.safe_load(fake_cluster.site.read_text())
    for node in ("head", "worker"):
        site[node].update(nccl_ib_hca="=mlx5_9", nccl_socket_ifname="lo")
    write_yaml(fake_cluster.site, site)
    result = cli("--site", fake_cluster.site, "start")
    assert result.rc == 1
    assert "head: NCCL_IB_GID_INDEX: no InfiniBand device" in result.err
    assert fake_cluster.docker_runs() == []
