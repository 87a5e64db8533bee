# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Read-only checks run on each node: model snapshot present, TCP ports free.

Stdlib only: the launcher runs this file as `python3 - CHECK ARGS...` on the worker with the
source on stdin, and with its own interpreter on the head, so both nodes run the same code.
Each check prints one JSON object: {"ok": bool, "detail": str}.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path


def snapshot_problem(hf_home: Path, model: str, revision: str) -> str | None:
    """Why the pinned snapshot is not usable offline, or None when every shard is present."""
    if revision == "-":
        directory = Path(model)
    else:
        repo = "models--" + model.replace("/", "--")
        directory = hf_home / "hub" / repo / "snapshots" / revision
    if not (directory / "config.json").is_file():
        return f"{directory}/config.json is missing (download the snapshot at this revision)"
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = [path.name for path in directory.glob("*.safetensors")]
        if not shards:
            return f"{directory} has no *.safetensors weights"
    missing = [shard for shard in shards if not (directory / shard).is_file()]
    if missing:
        return f"{directory} lacks {len(missing)} of {len(shards)} shards, first {missing[0]}"
    return None


def busy_ports(address: str, ports: list[int]) -> list[int]:
    busy = []
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((address, port))
            except OSError:
                busy.append(port)
    return busy


def main(argv: list[str]) -> int:
    check, args = argv[0], argv[1:]
    if check == "snapshot":
        problem = snapshot_problem(Path(args[0]), args[1], args[2])
        result = {"ok": problem is None, "detail": problem or "snapshot complete"}
    elif check == "ports":
        busy = busy_ports(args[0], [int(port) for port in args[1:]])
        detail = f"in use on {args[0]}: {', '.join(map(str, busy))}" if busy else "free"
        result = {"ok": not busy, "detail": detail}
    else:
        result = {"ok": False, "detail": f"unknown check {check!r}"}
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
