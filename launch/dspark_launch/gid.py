# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Resolve NCCL_IB_GID_INDEX on one node: the RoCE v2 GID that carries the node's IPv4 address.

GID indexes differ between nodes and move after reboots, so the launcher resolves them on each
node at every start instead of pinning a literal. Stdlib only: the launcher runs this file as
`python3 - HCA IPV4` on the worker, with the source on stdin.
"""

from __future__ import annotations

import ipaddress
import json
import re
import sys
from pathlib import Path

SYSFS_INFINIBAND = Path("/sys/class/infiniband")
_DEVICE = re.compile(r"[A-Za-z0-9_.-]+(:[0-9]+)?")


def parse_hca_selector(selector: str) -> tuple[bool, bool, list[tuple[str, int | None]]]:
    """NCCL's NCCL_IB_HCA grammar: `[^][=]dev[:port][,dev[:port]...]`.

    Returns (exclude, exact, [(device, port or None)]). Without `=`, names are prefixes.
    """
    rest = selector.strip()
    exclude = rest.startswith("^")
    rest = rest.removeprefix("^")
    exact = rest.startswith("=")
    rest = rest.removeprefix("=")
    items = [item.strip() for item in rest.split(",")]
    if not rest or any(not _DEVICE.fullmatch(item) for item in items):
        raise ValueError(
            f"{selector[:80]!r} is not an NCCL_IB_HCA selector like mlx5_0 or =mlx5_0:1"
        )
    devices = []
    for item in items:
        name, _, port = item.partition(":")
        devices.append((name, int(port) if port else None))
    return exclude, exact, devices


def select_ports(selector: str, sysfs: Path) -> list[Path]:
    """The `ports/<n>` directories NCCL would use for `selector`."""
    exclude, exact, wanted = parse_hca_selector(selector)
    present = sorted(p.name for p in sysfs.iterdir()) if sysfs.is_dir() else []

    def matches(device: str, name: str) -> bool:
        return device == name if exact else device.startswith(name)

    selected = []
    for device in present:
        hits = [port for name, port in wanted if matches(device, name)]
        if exclude:
            if not hits:
                selected += sorted((sysfs / device / "ports").glob("*"))
            continue
        for port in hits:
            ports = sysfs / device / "ports"
            selected += [ports / str(port)] if port is not None else sorted(ports.glob("*"))
    return selected


def roce_v2_indexes(port_dir: Path, ipv4: str) -> set[int]:
    """GID indexes on one port whose type is RoCE v2 and whose GID is the IPv4-mapped address."""
    packed = ipaddress.IPv4Address(ipv4).packed
    suffix = f"ffff:{packed[0]:02x}{packed[1]:02x}:{packed[2]:02x}{packed[3]:02x}"
    found = set()
    for gid_file in (port_dir / "gids").glob("*"):
        type_file = port_dir / "gid_attrs" / "types" / gid_file.name
        try:
            gid = gid_file.read_text().strip().lower()
            gid_type = type_file.read_text().strip()
        except OSError:
            continue  # unpopulated entries raise EINVAL on read
        if gid_type.lower() == "roce v2" and gid.endswith(suffix):
            found.add(int(gid_file.name))
    return found


def resolve_gid_index(selector: str, ipv4: str, sysfs: Path = SYSFS_INFINIBAND) -> int:
    """One index valid on every selected port; raises ValueError naming what is missing."""
    ports = select_ports(selector, sysfs)
    if not ports:
        raise ValueError(f"no InfiniBand device under {sysfs} matches NCCL_IB_HCA={selector}")
    common: set[int] | None = None
    for port in ports:
        indexes = roce_v2_indexes(port, ipv4)
        if not indexes:
            device = port.parent.parent.name
            raise ValueError(f"{device} port {port.name} has no RoCE v2 GID for {ipv4}")
        common = indexes if common is None else common & indexes
    if not common:
        raise ValueError(f"the ports selected by {selector} share no RoCE v2 GID index for {ipv4}")
    return min(common)


def main(argv: list[str]) -> int:
    selector, ipv4 = argv[0], argv[1]
    sysfs = Path(argv[2]) if len(argv) > 2 else SYSFS_INFINIBAND
    try:
        print(json.dumps({"gid_index": resolve_gid_index(selector, ipv4, sysfs)}))
    except ValueError as e:
        print(json.dumps({"error": str(e)}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
