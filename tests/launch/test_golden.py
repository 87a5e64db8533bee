# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Rendered commands of both nodes, as `--dry-run` prints them, against golden files.

Regenerate after an intended change with DSPARK_UPDATE_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dspark_launch.profile import PROFILES_DIR, load_profile
from dspark_launch.render import plan_node
from dspark_launch.site import load_site
from tests.launch.launch_testlib import API_KEY, HF_TOKEN, REPO, write_yaml

GOLDEN = Path(__file__).parent / "golden"
SITES = {
    "spark-docker": {
        "profile": "deepseek-v4-flash-2x-spark",
        "mode": "docker",
        "image": "ghcr.io/example/dspark-vllm-spark@sha256:" + "1" * 64,
        "ports": {"api": 8888, "master": 25000},
        "head": {
            "address": "10.10.0.1",
            "nccl_ib_hca": "rocep1s0f1",
            "nccl_socket_ifname": "enp1s0f1np1",
            "hf_home": "/srv/hf",
            "state_dir": "/var/lib/dspark",
        },
        "worker": {
            "ssh": "dgx@spark-b",
            "address": "10.10.0.2",
            "nccl_ib_hca": "=roceP2p1s0f1:1",
            "nccl_socket_ifname": "enP2p1s0f1np1",
            "gloo_socket_ifname": "enP2p1s0f0np0",
            "hf_home": "/data/hf",
            "state_dir": "/var/lib/dspark",
        },
        "nccl_passthrough": {"NCCL_NET_GDR_LEVEL": "LOC", "NCCL_IB_MERGE_NICS": ""},
        "secrets": {"api_key": API_KEY, "hf_token": HF_TOKEN},
    },
    "spark-docker-v2": {},  # spark-docker on the V2 lane (filled in below)
    "cpu-local": {
        "profile": "cpu-tiny",
        "mode": "local",
        "venv": "/opt/dspark/.venv",
        "api_bind": "127.0.0.1",
        "ports": {"api": 18000, "master": 29500},
        "head": {"address": "127.0.0.1", "hf_home": "/srv/hf", "state_dir": "/srv/dspark/run"},
        "worker": {"address": "127.0.0.1", "hf_home": "/srv/hf", "state_dir": "/srv/dspark/run"},
        "secrets": {"api_key": API_KEY},
    },
}

SITES["spark-docker-v2"] = {**SITES["spark-docker"], "lane": "v2"}


def _normalized(text: str) -> str:
    return text.replace(sys.executable, "<python>").replace(str(REPO), "<repo>")


@pytest.mark.parametrize("site_name", sorted(SITES))
@pytest.mark.parametrize("command", ["start", "stop"])
def test_dry_run_matches_golden(tmp_path, cli, site_name, command, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # a dry run must not run anything
    site = write_yaml(tmp_path / "site.yaml", SITES[site_name])
    result = cli("--site", site, "--dry-run", command)
    assert result.rc == 0, result.err
    assert API_KEY not in result.out and HF_TOKEN not in result.out
    golden = GOLDEN / f"{site_name}.{command}.txt"
    if os.environ.get("DSPARK_UPDATE_GOLDEN"):
        golden.write_text(_normalized(result.out))
    assert _normalized(result.out) == golden.read_text()


def test_ranks_differ_only_in_rank_role_and_network(tmp_path):
    """Everything else (model, parallelism, speculative config) must match across ranks."""
    site = load_site(write_yaml(tmp_path / "site.yaml", SITES["spark-docker"]))
    profile = load_profile(PROFILES_DIR / "deepseek-v4-flash-2x-spark.yaml")
    head, worker = (plan_node(profile, site, node, "3") for node in site.nodes)
    assert [a for a in worker.serve_args if a not in head.serve_args] == ["--headless"]
    rank_at = head.serve_args.index("--node-rank") + 1
    assert (head.serve_args[rank_at], worker.serve_args[rank_at]) == ("0", "1")
    assert len(head.serve_args) + 1 == len(worker.serve_args)
    different = {k for k in head.env if head.env[k] != worker.env.get(k)}
    assert different == {
        "VLLM_HOST_IP",
        "NCCL_IB_HCA",
        "NCCL_SOCKET_IFNAME",
        "GLOO_SOCKET_IFNAME",
        "TP_SOCKET_IFNAME",
        "VLLM_API_KEY",
    }
    assert "NCCL_IB_MERGE_NICS" not in head.env  # empty passthrough values stay unset


def test_the_lanes_differ_in_the_runner_alone(tmp_path):
    """Both lanes serve the profile's model, parallelism and flags; only the runner differs."""
    profile = load_profile(PROFILES_DIR / "deepseek-v4-flash-2x-spark.yaml")
    plans = {}
    for name in ("spark-docker", "spark-docker-v2"):
        site = load_site(write_yaml(tmp_path / f"{name}.yaml", SITES[name]))
        plans[site.lane] = [plan_node(profile, site, node, "3") for node in site.nodes]
    for v1, v2 in zip(plans["v1"], plans["v2"], strict=True):
        assert (v1.lane, v2.lane) == ("v1", "v2")
        assert v1.serve_args == v2.serve_args
        assert {k: v for k, v in v1.env.items() if v2.env[k] != v} == {
            "VLLM_USE_V2_MODEL_RUNNER": "0"
        }
        assert v2.env["VLLM_USE_V2_MODEL_RUNNER"] == "1"


def test_adaptive_verification_is_on_the_v2_lane_alone(tmp_path):
    path = tmp_path / "blackwell.yaml"
    text = (PROFILES_DIR / "deepseek-v4-flash-2x-spark.yaml").read_text()
    text = text.replace('compute_capability: ["12.1"]', 'compute_capability: ["10.0"]')
    path.write_text(text.replace("adaptive_verification: false", "adaptive_verification: true"))
    profile = load_profile(path)
    configs = {}
    for lane in ("v1", "v2"):
        site_file = write_yaml(tmp_path / f"{lane}.yaml", {**SITES["spark-docker"], "lane": lane})
        args = plan_node(profile, load_site(site_file), load_site(site_file).head).serve_args
        configs[lane] = json.loads(args[args.index("--speculative-config") + 1])
    assert configs["v2"] == {**configs["v1"], "enable_adaptive_verification": True}


def test_speculative_config_is_derived():
    profile = load_profile(PROFILES_DIR / "deepseek-v4-flash-2x-spark.yaml")
    config = json.loads(profile.speculative.config_json() or "")
    assert config == {
        "method": "dspark",
        "num_speculative_tokens": 5,
        "draft_sample_method": "probabilistic",
    }
    draft = replace(profile.speculative, draft_model="/models/draft", draft_sample_method="greedy")
    assert json.loads(draft.config_json() or "")["model"] == "/models/draft"
    tiny = load_profile(PROFILES_DIR / "cpu-tiny.yaml")
    assert tiny.speculative.config_json() is None


def test_golden_commands_are_valid_shell(tmp_path):
    """Every printed command line re-parses, so it can be pasted into a shell."""
    for golden in GOLDEN.glob("*.txt"):
        for line in golden.read_text().splitlines():
            if line.startswith("+ "):
                shlex.split(line[2:].split(" < ")[0])
