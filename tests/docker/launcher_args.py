# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The `vllm serve` arguments the two-node launcher gives each rank's container, rendered by the
launcher itself (launch/dspark_launch/render.py) from a shipped profile and a docker-mode site."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "launch"))

from dspark_launch.profile import load_profile  # noqa: E402
from dspark_launch.render import plan_node  # noqa: E402
from dspark_launch.site import load_site  # noqa: E402

PROFILE = REPO / "recipe" / "profiles" / "deepseek-v4-flash-2x-spark.yaml"


def write_docker_site(directory: Path, api_port: int) -> Path:
    """A docker-mode site for two nodes; nothing in it is contacted."""
    node_dirs = {role: directory / role for role in ("head", "worker")}
    for path in node_dirs.values():
        (path / "hf").mkdir(parents=True, exist_ok=True)
    site = {
        "profile": str(PROFILE),
        "mode": "docker",
        "image": "registry.example/dspark-vllm@sha256:" + "0" * 64,
        "api_bind": "127.0.0.1",
        "ports": {"api": api_port, "master": 29501},
        "head": {
            "address": "10.0.0.1",
            "hf_home": str(node_dirs["head"] / "hf"),
            "state_dir": str(node_dirs["head"] / "state"),
        },
        "worker": {
            "ssh": "dgx@spark-b",
            "address": "10.0.0.2",
            "hf_home": str(node_dirs["worker"] / "hf"),
            "state_dir": str(node_dirs["worker"] / "state"),
        },
    }
    path = directory / "site.yaml"
    path.write_text(yaml.safe_dump(site, sort_keys=False))
    path.chmod(0o600)
    return path


def rendered_ranks(directory: Path, api_port: int = 8000) -> dict[str, tuple[list[str], dict]]:
    """role -> (serve arguments, environment) of each rank, as the launcher renders them."""
    site = load_site(write_docker_site(directory, api_port))
    profile = load_profile(PROFILE)
    plans = {}
    for node in site.nodes:
        plan = plan_node(profile, site, node, gid_index="3")
        plans[node.role] = (list(plan.serve_args), plan.env)
    return plans
