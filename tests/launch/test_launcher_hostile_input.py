# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Hostile and broken launcher input: duplicate YAML keys, values that would become options,
secrets in error messages, abbreviated vLLM flags, `:` in volume paths, and the documented
behaviour of `logs`, `preflight` and an empty DSPARK_SITE."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from test_validation import _set, _site

from dspark_launch.profile import managed_flag
from tests.launch.launch_testlib import API_KEY, FAKES, FakeCluster, write_profile, write_yaml


@pytest.fixture
def check(tmp_path, cli, monkeypatch):
    """Run preflight on a site (a dict, or a file as written): expect exit 2 naming `message`
    before any command ran; return the error output."""
    log = tmp_path / "commands.log"
    monkeypatch.setenv("PATH", f"{FAKES}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))

    def run(site: dict | Path, message: str) -> str:
        path = site if isinstance(site, Path) else write_yaml(tmp_path / "site.yaml", site)
        result = cli("--site", path, "preflight")
        assert (result.rc, result.out) == (2, ""), result.err
        assert message in result.err, result.err
        assert not log.exists()
        return result.err

    return run


def test_duplicate_keys_are_refused_in_the_site_file(tmp_path, check):
    lines = yaml.safe_dump(_site(tmp_path), sort_keys=False).splitlines()
    api = next(i for i, line in enumerate(lines, 1) if line.strip().startswith("api:"))
    path = tmp_path / "dup.yaml"
    path.write_text("\n".join([*lines[:api], "  api: 9999", *lines[api:]]) + "\n")
    path.chmod(0o600)
    check(path, f"key 'api' appears twice: line {api} and line {api + 1}")
    path.write_text("\n".join([*lines, "mode: local"]) + "\n")
    mode = next(i for i, line in enumerate(lines, 1) if line.startswith("mode:"))
    check(path, f"key 'mode' appears twice: line {mode} and line {len(lines) + 1}")


def test_duplicate_keys_are_refused_in_the_profile(tmp_path, check):
    site = _site(tmp_path)
    profile = Path(site["profile"])
    lines = profile.read_text().splitlines()
    tp = next(i for i, line in enumerate(lines, 1) if line.startswith("tensor_parallel_size:"))
    profile.write_text("\n".join([*lines, "tensor_parallel_size: 4"]) + "\n")
    check(site, f"key 'tensor_parallel_size' appears twice: line {tp} and line {len(lines) + 1}")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("worker.ssh", "-Jevil.example"),
        ("worker.ssh", "-Fevil.conf"),
        ("worker.ssh", "dgx@-oProxyCommand=touch_x"),
        ("worker.nccl_socket_ifname", "-x"),
        ("head.nccl_ib_hca", "-mlx5_0"),
    ],
)
def test_values_that_would_become_options_are_refused(tmp_path, check, key, value):
    site = _site(tmp_path)
    _set(site, key, value)
    check(site, key)


def test_profile_model_may_not_be_an_option(tmp_path, check):
    site = _site(tmp_path)
    write_profile(Path(site["profile"]), model="--api-key=x", revision="a" * 40)
    check(site, "model: must not start with '-'")


def test_ssh_destination_always_follows_the_separator(fake_cluster: FakeCluster, cli):
    assert cli("--site", fake_cluster.site, "preflight").rc == 0
    ssh_runs = [entry["argv"] for entry in fake_cluster.commands() if entry["argv"][0] == "ssh"]
    assert ssh_runs
    for argv in ssh_runs:
        assert argv[argv.index("--") + 1] == "dgx@spark-b", argv


@pytest.mark.parametrize(
    "value", [123456789, ["sk-SECRET-list"], "sk-SECRET\nsecond-line", {"k": "sk-SECRET-map"}]
)
def test_schema_errors_never_show_a_secret(tmp_path, check, value):
    site = _site(tmp_path)
    site["secrets"] = {"api_key": value}
    shown = check(site, "secrets.api_key")
    for fragment in ("123456789", "sk-SECRET"):
        assert fragment not in shown


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--api-k=KEY-SECRET"], "--api-key"),
        (["--api_key", "KEY-SECRET"], "--api-key"),
        (["--hea"], "--headless"),
        (["--tensor-parallel=4"], "--tensor-parallel-size"),
        (["-tp=4"], "--tensor-parallel-size"),
        (["-t", "4"], "--tensor-parallel-size"),
        (["-n2"], "--nnodes"),
        (["-r", "1"], "--node-rank"),
        (["--speculative-config.method", "eagle"], "--speculative-config"),
        (["-sc", "{}"], "--speculative-config"),
        (["--no-enforce-eager"], "--enforce-eager"),
        (["--config", "/tmp/x.yaml"], "--config"),
        (["--max-cudagraph-capture-si=8"], "--max-cudagraph-capture-size"),
    ],
)
def test_abbreviated_managed_flags_are_refused(tmp_path, check, args, flag):
    site = _site(tmp_path)
    write_profile(Path(site["profile"]), serve_args=args)
    shown = check(site, f"sets {flag}, which the launcher sets")
    assert "SECRET" not in shown


@pytest.mark.parametrize(
    "arg",
    ["--max-num-batched-tokens=8192", "--enable-prefix-caching", "-q", "--quantization", "8192"],
)
def test_other_vllm_flags_pass(arg):
    assert managed_flag(arg) is None


def test_colon_in_a_volume_path_is_refused(tmp_path, check):
    site = _site(tmp_path)
    site["worker"]["hf_home"] = "/srv/hf:/etc"
    check(site, "worker.hf_home: must not contain ':'")


def test_logs_print_the_reachable_rank_and_fail_for_the_other(fake_cluster, cli):
    (fake_cluster.root / "unreachable").touch()
    result = cli("--site", fake_cluster.site, "logs")
    assert result.rc == 1
    assert "fake log line from head" in result.out
    assert "worker (dgx@spark-b): unreachable over ssh" in result.err


def test_preflight_tells_a_stopped_daemon_from_a_missing_image(fake_cluster, cli):
    fake_cluster.scenario(worker={"daemon_down": True})
    result = cli("--site", fake_cluster.site, "preflight")
    assert result.rc == 1
    assert "worker (dgx@spark-b): docker cannot inspect images" in result.err
    assert "Docker daemon" in result.err and "is not present" not in result.err

    fake_cluster.scenario(worker={"image_id": None})
    result = cli("--site", fake_cluster.site, "preflight")
    assert result.rc == 1 and "is not present" in result.err


def test_empty_dspark_site_is_a_configuration_error(cli, monkeypatch):
    monkeypatch.setenv("DSPARK_SITE", "")
    result = cli("preflight")
    assert result.rc == 2
    assert "DSPARK_SITE is set but empty" in result.err and "cannot read" not in result.err
    assert API_KEY not in result.err
