# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Read-only checks run on each node: model snapshot present, TCP ports free.

Stdlib and `dspark_common.operator_input` only: the launcher runs this file as
`python3 - CHECK ARGS...` on the worker with the source (and that module, `Shell.run_script`) on
stdin, and with its own interpreter on the head, so both nodes run the same code.
Each check prints one JSON object: {"ok": bool, "detail": str}.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

from dspark_common.operator_input import NotReadable, describe, escaped, read_text

INDEX_MAX_BYTES = 64 << 20
"""Largest `model.safetensors.index.json` read (DeepSeek-V4-Flash's is a few MiB)."""


def snapshot_problem(hf_home: Path, model: str, revision: str) -> str | None:
    """Why the pinned snapshot is not usable offline, or None when every shard is present."""
    if revision == "-":
        directory = Path(model)
    else:
        repo = "models--" + model.replace("/", "--")
        directory = hf_home / "hub" / repo / "snapshots" / revision
    config = directory / "config.json"
    kind = describe(config)
    if kind == "does not exist":
        return f"{escaped(str(config))} is missing (download the snapshot at this revision)"
    if kind != "is a regular file":
        return f"{escaped(str(config))} {kind}, not a regular file"
    index = directory / "model.safetensors.index.json"
    if describe(index) != "does not exist":
        try:
            text = read_text(index, INDEX_MAX_BYTES)[0]
        except NotReadable as error:
            return str(error)
        try:
            shards = sorted(set(json.loads(text)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            return f"{escaped(str(index))}: not a safetensors index ({escaped(repr(error))})"
    else:
        shards = [path.name for path in directory.glob("*.safetensors")]
        if not shards:
            return f"{escaped(str(directory))} has no *.safetensors weights"
    missing = [shard for shard in shards if not (directory / shard).is_file()]
    if missing:
        return (
            f"{escaped(str(directory))} lacks {len(missing)} of {len(shards)} shards, "
            f"first {escaped(str(missing[0]))}"
        )
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
        result = {"ok": False, "detail": f"unknown check {escaped(repr(check))}"}
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
