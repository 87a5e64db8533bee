# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Render what each rank runs: the `vllm serve` arguments and the environment file.

Both ranks are rendered from the same profile by the same function, so everything that must
agree across ranks (a `--speculative-config` mismatch deadlocked NCCL) agrees by construction;
only node rank, `--headless` and the per-node network settings differ.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark_launch.lanes import V1, runner_env
from dspark_launch.profile import Profile
from dspark_launch.schema import is_one_line
from dspark_launch.site import HEAD, Node, Site

# Fixed NCCL settings for ConnectX-7 RoCE between two DGX Sparks (docs/two-node-launch.md).
NCCL_ROCE_ENV = {
    "NCCL_NET": "IB",
    "NCCL_IB_DISABLE": "0",
    "NCCL_IB_ADDR_FAMILY": "AF_INET",
    "NCCL_IB_ROCE_VERSION_NUM": "2",
    "NCCL_CROSS_NIC": "1",
    "NCCL_CUMEM_ENABLE": "0",
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_IGNORE_CPU_AFFINITY": "1",
    "NCCL_DEBUG": "WARN",
}
CONTAINER_HF_HOME = "/hf"
GID_PLACEHOLDER = "<resolved on the node at start>"
REDACTED = "<redacted>"


@dataclass(frozen=True)
class NodePlan:
    """One rank: its `vllm serve` arguments and the environment its env file carries.
    `lane` is the model runner serving DSpark; preflight's checks run for it."""

    node: Node
    serve_args: tuple[str, ...]
    env: dict[str, str]
    secret_keys: frozenset[str]
    lane: str = V1

    def env_file_text(self, redact: bool = False) -> str:
        """`KEY=VALUE` lines, the format `docker run --env-file` reads (no quoting): it splits
        the file on `\n` only, so no value may hold any line break (the site and profile
        readers refuse them; this is the last guard)."""
        for key, value in self.env.items():
            if not is_one_line(value):
                raise ValueError(f"env value of {key} holds a line break or NUL")
        lines = [
            f"{key}={REDACTED if redact and key in self.secret_keys else value}"
            for key, value in self.env.items()
        ]
        return "\n".join(lines) + "\n"


def serve_args(profile: Profile, site: Site, node: Node) -> tuple[str, ...]:
    args = [profile.model]
    if profile.revision:
        args += ["--revision", profile.revision]
    args += [
        "--served-model-name",
        profile.served_model_name,
        "--tensor-parallel-size",
        str(profile.tensor_parallel_size),
        "--pipeline-parallel-size",
        "1",
        "--distributed-executor-backend",
        "mp",
    ]
    if profile.nodes == 2:
        args += [
            "--nnodes",
            "2",
            "--node-rank",
            str(node.rank),
            "--master-addr",
            site.head.address,
            "--master-port",
            str(site.master_port),
        ]
    args += [
        "--max-num-seqs",
        str(profile.max_num_seqs),
        "--max-model-len",
        str(profile.max_model_len),
        "--kv-cache-dtype",
        profile.kv_cache_dtype,
    ]
    if profile.dtype:
        args += ["--dtype", profile.dtype]
    speculative = profile.speculative.config_json(profile.lanes[site.lane].adaptive_verification)
    if speculative:
        args += ["--speculative-config", speculative]
    if not profile.cuda_graphs:
        args.append("--enforce-eager")
    args += profile.serve_args
    if node.role != HEAD and profile.nodes == 2:
        args.append("--headless")
    elif site.mode == "local":  # the image's entrypoint binds from DSPARK_HOST/DSPARK_PORT
        args += ["--host", site.api_bind, "--port", str(site.api_port)]
    return tuple(args)


def node_env(profile: Profile, site: Site, node: Node, gid_index: str | None) -> dict[str, str]:
    env = {**runner_env(site.lane), **profile.env}
    env["VLLM_HOST_IP"] = node.address
    if profile.nccl_roce:
        socket_ifname = node.gloo_socket_ifname or node.nccl_socket_ifname or ""
        env.update(NCCL_ROCE_ENV)
        env["NCCL_IB_HCA"] = node.nccl_ib_hca or ""
        env["NCCL_SOCKET_IFNAME"] = node.nccl_socket_ifname or ""
        env["NCCL_IB_GID_INDEX"] = gid_index or GID_PLACEHOLDER
        env["GLOO_SOCKET_IFNAME"] = socket_ifname
        env["TP_SOCKET_IFNAME"] = socket_ifname
        env.update(site.nccl_passthrough)
    if site.mode == "docker":
        env["HF_HOME"] = CONTAINER_HF_HOME
        env["DSPARK_HOST"] = site.api_bind
        env["DSPARK_PORT"] = str(site.api_port)
    else:
        env["HF_HOME"] = str(node.hf_home)
    if site.secrets.hf_token:
        env["HF_TOKEN"] = site.secrets.hf_token
    if site.secrets.api_key and node.role == HEAD:  # the headless worker serves no API
        env["VLLM_API_KEY"] = site.secrets.api_key
    return env


def plan_node(profile: Profile, site: Site, node: Node, gid_index: str | None = None) -> NodePlan:
    return NodePlan(
        node=node,
        serve_args=serve_args(profile, site, node),
        env=node_env(profile, site, node, gid_index),
        secret_keys=frozenset({"HF_TOKEN", "VLLM_API_KEY"}),
        lane=site.lane,
    )


def parse_env_file(text: str) -> dict[str, str]:
    """Read back an env file written by `NodePlan.env_file_text` (never `source` it), as
    `docker --env-file` reads it: split on `\n` only (`str.splitlines` also splits on
    U+2028, `\x1c`, ... and would read an extra variable out of one value)."""
    env = {}
    for line in text.split("\n"):
        if line:
            key, sep, value = line.partition("=")
            if not sep:
                raise ValueError(f"env file line without '=': {key[:40]!r}")
            env[key] = value
    return env
