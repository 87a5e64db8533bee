# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Every site-file and profile rule: exit status 2, the offending key named, nothing run."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dspark_launch.errors import ConfigError
from dspark_launch.profile import PROFILES_DIR, load_profile
from dspark_launch.site import load_site
from tests.launch.launch_testlib import FAKE_IMAGE, write_profile, write_yaml


def _site(tmp_path: Path) -> dict:
    return {
        "profile": str(write_profile(tmp_path / "profile.yaml")),
        "mode": "docker",
        "image": FAKE_IMAGE,
        "ports": {"api": 8888, "master": 25000},
        "head": {"address": "10.0.0.1", "hf_home": "/srv/hf", "state_dir": "/var/lib/dspark"},
        "worker": {
            "ssh": "dgx@spark-b",
            "address": "10.0.0.2",
            "hf_home": "/srv/hf",
            "state_dir": "/var/lib/dspark",
        },
    }


def _set(data: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        data = data.setdefault(key, {})
    if value is _DELETE:
        del data[last]
    else:
        data[last] = value


_DELETE = object()

SITE_RULES = [
    ("mode", "kubernetes", "mode: must be one of docker, local; got 'kubernetes'"),
    ("head.address", _DELETE, "head.address: required key is missing"),
    ("worker.nccl_ib_hac", "mlx5_0", "worker.nccl_ib_hac: unknown key"),
    ("ports.api", "8888", "ports.api: must be an integer, got '8888'"),
    ("ports.api", True, "ports.api: must be an integer, got True"),
    ("ports.master", 70000, "ports.master: must be between 1 and 65535, got 70000"),
    ("ports.master", 8888, "ports.master: must differ from ports.api (8888)"),
    ("health.interval_s", 0, "health.interval_s: must be between 1 and 600, got 0"),
    (
        "image",
        "dspark-vllm:latest",
        "image: 'dspark-vllm:latest' is not an image pinned by repo digest",
    ),
    ("venv", "/opt/venv", "venv: is for local mode"),
    ("head.ssh", "root@spark-a", "head.ssh: only the worker in docker mode is reached over ssh"),
    ("worker.ssh", _DELETE, "worker.ssh: required key is missing"),
    ("worker.ssh", "dgx@spark b", "worker.ssh: 'dgx@spark b' is not an ssh destination"),
    ("head.address", "10.0.0.300", "head.address: '10.0.0.300' is not an IPv4 address"),
    ("api_bind", "localhost", "api_bind: 'localhost' is not an IPv4 address"),
    (
        "head.nccl_ib_hca",
        "mlx5_0;rm -rf",
        "head.nccl_ib_hca: 'mlx5_0;rm -rf' is not an NCCL_IB_HCA",
    ),
    ("worker.nccl_socket_ifname", "eth0 eth1", "worker.nccl_socket_ifname: 'eth0 eth1' is not a"),
    ("head.state_dir", "state", "head.state_dir: must be an absolute path, got 'state'"),
    ("head.hf_home", "/srv/hf\n--volume", "head.hf_home: must be a single line"),
    ("nccl_passthrough.NCCL_DEBUG", "INFO", "nccl_passthrough.NCCL_DEBUG: must be one of"),
    ("nccl_passthrough.NCCL_NET_GDR_LEVEL", 2, "nccl_passthrough.NCCL_NET_GDR_LEVEL: must be a"),
    ("profile", "no-such-profile", "no-such-profile.yaml does not exist"),
    ("secrets.api_key", ["a", "b"], "secrets.api_key: must be a non-empty string"),
    ("lane", "v3", "lane: must be one of v1, v2; got 'v3'"),
    ("lane", "v2", "lane: profile profile serves the v1 lane(s), not v2 (docs/lanes.md)"),
]


@pytest.fixture
def check(tmp_path, cli, monkeypatch):
    """Write the site, run preflight with recording fakes, expect exit 2 and `message`."""
    from tests.launch.launch_testlib import FAKES

    log = tmp_path / "commands.log"
    monkeypatch.setenv("PATH", f"{FAKES}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))

    def run(site: dict, message: str, mode: int = 0o600) -> None:
        path = write_yaml(tmp_path / "site.yaml", site, mode)
        result = cli("--site", path, "preflight")
        assert (result.rc, result.out) == (2, ""), result.err
        assert message in result.err
        assert not log.exists()  # rejected before any command ran

    return run


@pytest.mark.parametrize(("key", "value", "message"), SITE_RULES)
def test_site_rule(tmp_path, check, key, value, message):
    site = _site(tmp_path)
    _set(site, key, value)
    check(site, message)


def test_a_misspelled_required_key_is_named_beside_the_missing_one(tmp_path, check):
    site = _site(tmp_path)
    site["head"]["adress"] = site["head"].pop("address")
    check(site, "head.address: required key is missing (the file has 'adress': a misspelling")
    del site["head"]["adress"]  # the control: nothing close, nothing suggested
    check(site, "head.address: required key is missing\n")


def test_local_mode_rejects_image_and_worker_ssh(tmp_path, check):
    site = _site(tmp_path)
    site.update(mode="local", venv="/opt/venv")
    check(site, "image: is for docker mode")
    del site["image"]
    check(site, "worker.ssh: only the worker in docker mode is reached over ssh (local)")
    del site["worker"]["ssh"]
    site["venv"] = "venv"
    check(site, "venv: must be an absolute path")


def test_mutually_exclusive_secrets(tmp_path, check):
    site = _site(tmp_path)
    site["secrets"] = {"api_key": "k", "api_key_file": str(tmp_path / "key")}
    check(site, "secrets.api_key and secrets.api_key_file are mutually exclusive")


def test_inline_secret_needs_a_private_site_file(tmp_path, check):
    site = _site(tmp_path)
    site["secrets"] = {"hf_token": "hf_x"}
    check(site, "secrets.hf_token: is inline, so", mode=0o644)


def test_secret_files_must_be_private_and_one_line(tmp_path, check):
    key_file = tmp_path / "api-key"
    site = _site(tmp_path)
    site["secrets"] = {"api_key_file": str(key_file)}
    check(site, "secrets.api_key_file: cannot read")
    key_file.write_text("sk-1\n")
    key_file.chmod(0o644)
    check(site, f"{key_file} is readable by others: chmod 600")
    key_file.chmod(0o600)
    key_file.write_text("sk-1\nsk-2\n")
    check(site, "must hold exactly one non-empty line")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\xef\xbb\xbfmode: docker\n", "starts with a UTF-8 byte-order mark"),
        (b"mode: docker\r\nimage: x\r\n", "line 1 has a carriage return"),
        (b"mode: d\xe9j\xe0\n", "not valid UTF-8 at byte 7"),
        (b"mode: [docker\n", "invalid YAML at line 2"),
        (b"- docker\n", "must be a YAML mapping"),
    ],
)
def test_site_file_encoding_and_syntax(tmp_path, cli, raw, message):
    path = tmp_path / "site.yaml"
    path.write_bytes(raw)
    result = cli("--site", path, "preflight")
    assert result.rc == 2 and message in result.err


def test_no_site_file_is_a_configuration_error(cli, monkeypatch):
    monkeypatch.delenv("DSPARK_SITE", raising=False)
    result = cli("preflight")
    assert result.rc == 2 and "pass --site FILE or set DSPARK_SITE" in result.err


ADAPTIVE_DSPARK = {
    "speculative": {"method": "dspark", "num_speculative_tokens": 3},
    "lanes": ["v1", "v2"],
    "v2_lane": {"adaptive_verification": True},
}

PROFILE_RULES = [
    ({"revision": "main"}, "revision: 'main' is not a 40-hex commit id"),
    ({"revision": None}, "revision: required key is missing"),
    ({"speculative": {"method": "eagle"}}, "speculative.method: must be one of dspark, none"),
    ({"speculative": {"method": "dspark"}}, "num_speculative_tokens: required when method is dsp"),
    (
        {"speculative": {"method": "dspark", "num_speculative_tokens": 0}},
        "speculative.num_speculative_tokens: must be between 1 and 16, got 0",
    ),
    (
        {
            "speculative": {
                "method": "dspark",
                "num_speculative_tokens": 5,
                "draft_sample_method": 'greedy","method":"eagle',
            }
        },
        "speculative.draft_sample_method: must be one of probabilistic, greedy",
    ),
    (
        {"serve_args": ["--max-cudagraph-capture-size=8"]},
        "serve_args: '--max-cudagraph-capture-size' sets",
    ),
    (
        {"serve_args": ["--api-key", "k"]},
        "'--api-key' sets --api-key, which the launcher sets from site secrets",
    ),
    ({"serve_args": "--enforce-eager"}, "serve_args: must be a list of strings"),
    ({"env": {"VLLM_API_KEY": "k"}}, "env.VLLM_API_KEY: is set by the launcher"),
    ({"env": {"NCCL_IB_GID_INDEX": "3"}}, "env.NCCL_IB_GID_INDEX: is set by the launcher"),
    ({"env": {"VLLM_CPU_KVCACHE_SPACE": 1}}, "env.VLLM_CPU_KVCACHE_SPACE: must be a quoted string"),
    ({"env": {"lower": "1"}}, "env: 'lower' is not an environment variable name"),
    ({"tensor_parallel_size": 3}, "tensor_parallel_size: must be even"),
    ({"cuda_graphs": "yes"}, "cuda_graphs: must be true or false, got 'yes'"),
    ({"start_order": "together"}, "start_order: must be one of worker-first, head-first"),
    ({"max_num_seqs": 0}, "max_num_seqs: must be between 1 and 4096, got 0"),
    ({"model": "/models/x"}, "revision: must be omitted when model is a local directory"),
    ({"nccl_roce": True}, "head.nccl_ib_hca: required by profile"),
    ({"model": "/models/x", "revision": None}, "mode: docker serves hub snapshots from hf_home"),
    (
        {"env": {"VLLM_USE_V2_MODEL_RUNNER": "1"}},
        "env.VLLM_USE_V2_MODEL_RUNNER: is set by the launcher from the site file's lane",
    ),
    ({"lanes": ["v1", "v3"]}, "lanes: must list some of v1, v2; got 'v3'"),
    ({"lanes": ["v2", "v2"]}, "lanes: lists a lane twice"),
    ({"lanes": "v2"}, "lanes: must be a list of strings"),
    ({"compute_capability": ["sm_121"]}, "compute_capability: 'sm_121' is not like \"12.1\""),
    (
        {"v2_lane": {"adaptive_verification": True}},
        "v2_lane: is for the V2 lane, which lanes does not list",
    ),
    (
        {"lanes": ["v2"], "v2_lane": {"adaptive_verification": True}},
        "v2_lane.adaptive_verification: is DSpark's: it needs speculative.method: dspark",
    ),
    (
        {**ADAPTIVE_DSPARK, "cuda_graphs": False, "compute_capability": ["10.0"]},
        "v2_lane.adaptive_verification: needs cuda_graphs: true",
    ),
    (ADAPTIVE_DSPARK, "v2_lane.adaptive_verification: needs compute_capability"),
    (
        {**ADAPTIVE_DSPARK, "compute_capability": ["10.0", "12.1"]},
        "v2_lane.adaptive_verification: of the images' targets, vLLM 0.33.0 verifies "
        "adaptively on compute capability 10.x (B200, B300) only, not on 12.1; set it to false",
    ),
    ({"v2_lane": {"adaptive_verifcation": True}}, "v2_lane.adaptive_verifcation: unknown key"),
]


@pytest.mark.parametrize(("overrides", "message"), PROFILE_RULES)
def test_profile_rule(tmp_path, check, overrides, message):
    site = _site(tmp_path)
    write_profile(Path(site["profile"]), **overrides)
    profile = yaml.safe_load(Path(site["profile"]).read_text())
    kept = {key: value for key, value in profile.items() if value is not None}
    Path(site["profile"]).write_text(yaml.safe_dump(kept))
    check(site, message)


def test_roce_profile_needs_two_hosts(tmp_path, check):
    site = _site(tmp_path)
    site.update(mode="local", venv="/opt/venv", profile="deepseek-v4-flash-2x-spark")
    del site["image"], site["worker"]["ssh"]
    check(site, "mode: local runs both ranks on one host")


def test_adaptive_verification_on_blackwell_servers_is_the_v2_lanes_alone(tmp_path):
    path = write_profile(
        tmp_path / "p.yaml", **ADAPTIVE_DSPARK, compute_capability=["10.0", "10.3"]
    )
    profile = load_profile(path)
    assert profile.lanes["v2"].adaptive_verification
    assert not profile.lanes["v1"].adaptive_verification


def test_shipped_profiles_are_valid():
    names = sorted(path.stem for path in PROFILES_DIR.glob("*.yaml"))
    assert names == [
        "cpu-tiny",
        "deepseek-v4-flash-2x-spark",
        "deepseek-v4-flash-b200",
        "qwen3-8b-dspark-blackwell",
    ]
    for name in names:
        load_profile(PROFILES_DIR / f"{name}.yaml")


def test_a_one_host_profile_is_not_launched(tmp_path, check):
    site = _site(tmp_path)
    site["profile"] = "qwen3-8b-dspark-blackwell"
    check(site, "serves one host (nodes: 1); dspark-launch starts two-node deployments")


def test_profile_errors_name_the_file(tmp_path):
    path = write_profile(tmp_path / "p.yaml", max_model_len="long")
    with pytest.raises(ConfigError, match=r"p\.yaml: max_model_len: must be an integer"):
        load_profile(path)


def test_secrets_never_show_in_a_repr(tmp_path):
    site = _site(tmp_path)
    site["secrets"] = {"api_key": "sk-hidden", "hf_token": "hf_hidden"}
    loaded = load_site(write_yaml(tmp_path / "site.yaml", site))
    assert loaded.secrets.api_key == "sk-hidden"
    assert "hidden" not in repr(loaded)
