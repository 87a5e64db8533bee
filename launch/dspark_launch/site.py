# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The site file: everything that differs per cluster (hosts, NICs, ports, paths, secrets).

Validated completely before any command runs. Secrets are read into memory here and leave the
process only through 0600 env files, never through command lines or logs.
"""

from __future__ import annotations

import ipaddress
import stat
from dataclasses import dataclass
from pathlib import Path

from dspark_common.operator_input import NotReadable, escaped, read_text, shown
from dspark_launch.errors import ConfigError
from dspark_launch.gid import parse_hca_selector
from dspark_launch.lanes import LANES, V1
from dspark_launch.profile import Profile
from dspark_launch.schema import Section, is_one_line, read_yaml

MODES = ("docker", "local")
HEAD, WORKER = "head", "worker"
# A repository digest (NAME@sha256:..., what a registry serves), or an image ID (sha256:...,
# the content address that `docker save | docker load` keeps; a loaded image has no repo digest).
_IMAGE_PIN = r"[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}|sha256:[0-9a-f]{64}"
_IFNAME = r"[A-Za-z0-9_.:-]{1,15}"
_SSH_TARGET = r"([A-Za-z0-9][A-Za-z0-9._-]*@)?[A-Za-z0-9][A-Za-z0-9._-]*"
MAX_SECRET_BYTES = 16 << 10
"""Largest secret file read: a token or an API key is one line, far shorter."""
NCCL_PASSTHROUGH = (
    "NCCL_IB_MERGE_NICS",
    "NCCL_NET_GDR_LEVEL",
    "NCCL_NET_GDR_READ",
    "NCCL_DMABUF_ENABLE",
)


@dataclass(frozen=True)
class Node:
    role: str  # "head" or "worker"
    rank: int
    address: str  # this node's IP on the inter-node link: VLLM_HOST_IP; the head's is master-addr
    ssh: str | None  # worker in docker mode only; the head is the machine the launcher runs on
    nccl_ib_hca: str | None
    nccl_socket_ifname: str | None
    gloo_socket_ifname: str | None
    hf_home: Path
    state_dir: Path


@dataclass(frozen=True)
class Secrets:
    hf_token: str | None
    api_key: str | None

    def __repr__(self) -> str:  # never print secret values, even in a traceback
        def masked(value: str | None) -> str | None:
            return "***" if value else None

        return f"Secrets(hf_token={masked(self.hf_token)}, api_key={masked(self.api_key)})"


@dataclass(frozen=True)
class Site:
    path: Path
    profile: str
    mode: str
    image: str | None
    venv: Path | None
    api_bind: str
    api_port: int
    master_port: int
    health_timeout_s: int
    health_interval_s: int
    head: Node
    worker: Node
    secrets: Secrets
    nccl_passthrough: dict[str, str]
    lane: str = V1  # which model runner serves DSpark (docs/lanes.md)

    @property
    def nodes(self) -> tuple[Node, Node]:
        return (self.head, self.worker)

    @property
    def probe_host(self) -> str:
        """Where the API answers: the bind address, or loopback for a wildcard bind."""
        return "127.0.0.1" if self.api_bind == "0.0.0.0" else self.api_bind


def _ipv4(section: Section, key: str) -> str:
    value = section.string(key)
    assert value is not None
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        raise section.error(key, f"{shown(value)} is not an IPv4 address") from None
    return value


def _node(top: Section, role: str, rank: int, mode: str) -> Node:
    section = top.section(role)
    ssh = None
    if role == WORKER and mode == "docker":
        ssh = section.matching("ssh", _SSH_TARGET, "an ssh destination like user@host")
    elif section.has("ssh"):
        raise section.error("ssh", f"only the worker in docker mode is reached over ssh ({mode})")
    hca = section.string("nccl_ib_hca", required=False)
    if hca is not None:
        try:
            parse_hca_selector(hca)
        except ValueError as e:
            raise section.error("nccl_ib_hca", str(e)) from None
    node = Node(
        role=role,
        rank=rank,
        address=_ipv4(section, "address"),
        ssh=ssh,
        nccl_ib_hca=hca,
        nccl_socket_ifname=section.matching(
            "nccl_socket_ifname", _IFNAME, "a network interface name", required=False
        ),
        gloo_socket_ifname=section.matching(
            "gloo_socket_ifname", _IFNAME, "a network interface name", required=False
        ),
        hf_home=_absolute(section, "hf_home", volume=mode == "docker"),
        state_dir=_absolute(section, "state_dir"),
    )
    section.finish()
    return node


def _absolute(section: Section, key: str, volume: bool = False) -> Path:
    """`volume`: the path is mounted with `docker run --volume PATH:...`, where a `:` would
    split it."""
    value = section.string(key)
    assert value is not None
    if not value.startswith("/"):
        raise section.error(key, f"must be an absolute path, got {shown(value)}")
    if volume and ":" in value:
        raise section.error(
            key,
            f"must not contain ':' (docker --volume reads it as a separator), got {shown(value)}",
        )
    return Path(value)


def _secret(section: Section, key: str, site_path: Path) -> str | None:
    """A secret inline (the site file must then be private) or in a private file."""
    section.exclusive(key, f"{key}_file")
    if section.has(key):
        value = section.string(key, secret=True)
        if stat.S_IMODE(site_path.stat().st_mode) & 0o077:
            name = escaped(str(site_path))
            raise section.error(key, f"is inline, so {name} must be private: chmod 600 {name}")
        return value
    file_key = f"{key}_file"
    if not section.has(file_key):
        return None
    path = Path(section.string(file_key) or "")
    name = escaped(str(path))
    try:
        text, mode = read_text(path, MAX_SECRET_BYTES)
    except NotReadable as e:
        raise section.error(file_key, f"cannot read it: {e}") from None
    if mode & 0o077:
        raise section.error(file_key, f"{name} is readable by others: chmod 600 {name}")
    value = text.strip()
    if not value or not is_one_line(value):
        raise section.error(
            file_key, f"{name} must hold exactly one non-empty line (no line or page breaks)"
        )
    return value


def load_site(path: Path) -> Site:
    top = Section(read_yaml(path), path)
    mode = top.choice("mode", MODES)
    image = venv = None
    if mode == "docker":
        image = top.matching(
            "image",
            _IMAGE_PIN,
            "an image pinned by repo digest (NAME@sha256:...) or by image ID (sha256:...)",
        )
        if top.has("venv"):
            raise top.error("venv", "is for local mode; docker mode runs the image's vLLM")
    else:
        venv_text = top.string("venv")
        venv = Path(venv_text or "")
        if not venv.is_absolute():
            raise top.error("venv", f"must be an absolute path, got {shown(venv_text)}")
        if top.has("image"):
            raise top.error("image", "is for docker mode; local mode runs the venv's vLLM")
    ports = top.section("ports")
    api_port = ports.integer("api", 1, 65535)
    master_port = ports.integer("master", 1, 65535)
    if api_port == master_port:
        raise ports.error("master", f"must differ from ports.api ({api_port})")
    ports.finish()
    health = top.section("health", required=False)
    health_timeout_s = health.integer("timeout_s", 1, 86400, default=2400)
    health_interval_s = health.integer("interval_s", 1, 600, default=15)
    health.finish()
    secrets_section = top.section("secrets", required=False)
    secrets = Secrets(
        hf_token=_secret(secrets_section, "hf_token", path),
        api_key=_secret(secrets_section, "api_key", path),
    )
    secrets_section.finish()
    passthrough = top.string_map("nccl_passthrough")
    for name in passthrough:
        if name not in NCCL_PASSTHROUGH:
            raise top.error(
                f"nccl_passthrough.{name}", f"must be one of {', '.join(NCCL_PASSTHROUGH)}"
            )
    api_bind = top.string("api_bind", default="0.0.0.0") or "0.0.0.0"
    try:
        ipaddress.IPv4Address(api_bind)
    except ValueError:
        raise top.error("api_bind", f"{shown(api_bind)} is not an IPv4 address") from None
    site = Site(
        path=path,
        profile=top.string("profile") or "",
        mode=mode,
        image=image,
        venv=venv,
        api_bind=api_bind,
        api_port=api_port,
        master_port=master_port,
        health_timeout_s=health_timeout_s,
        health_interval_s=health_interval_s,
        head=_node(top, HEAD, 0, mode),
        worker=_node(top, WORKER, 1, mode),
        secrets=secrets,
        # An empty value would mask NCCL's own config file, so empty means unset.
        nccl_passthrough={k: v for k, v in passthrough.items() if v.strip()},
        lane=top.choice("lane", LANES, default=V1),
    )
    top.finish()
    return site


def check_compatible(site: Site, profile: Profile) -> None:
    """Cross-file rules: what the profile needs from the site."""
    profile_name, site_name = escaped(profile.name), escaped(str(site.path))
    if profile.nodes != 2:
        raise ConfigError(
            f"profile {profile_name} serves one host (nodes: 1); dspark-launch starts two-node "
            "deployments: serve it with `docker run` (docs/docker.md) after "
            f"`python -m tools.dry_start --profile {profile_name}` (docs/dry-start.md)"
        )
    if site.lane not in profile.lanes:
        raise ConfigError(
            f"{site_name}: lane: profile {profile_name} serves the {', '.join(profile.lanes)} "
            f"lane(s), not {site.lane} (docs/lanes.md)"
        )
    if not profile.uses_hub_snapshot and site.mode == "docker":
        raise ConfigError(
            f"{site_name}: mode: docker serves hub snapshots from hf_home, but profile "
            f"{profile_name} names a local model directory; use mode: local or a hub model"
        )
    if not profile.nccl_roce:
        return
    if site.mode == "local":
        raise ConfigError(
            f"{site_name}: mode: local runs both ranks on one host, but profile {profile_name} "
            "uses NCCL over RoCE between two hosts; use mode: docker"
        )
    for node in site.nodes:
        for key in ("nccl_ib_hca", "nccl_socket_ifname"):
            if getattr(node, key) is None:
                raise ConfigError(
                    f"{site_name}: {node.role}.{key}: required by profile {profile_name} "
                    "(NCCL over RoCE); see `ibdev2netdev` on that node"
                )
