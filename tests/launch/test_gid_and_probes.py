# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The per-node probes on fake sysfs trees and real sockets, run the way the launcher runs them
on a worker: as a script on stdin, outside the package."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_launch import gid, node_probe
from dspark_launch.gid import parse_hca_selector, resolve_gid_index
from dspark_launch.shell import bundled
from tests.launch.launch_testlib import fake_snapshot

IPV4_GID = "0000:0000:0000:0000:0000:ffff:{}"  # IPv4-mapped GID, e.g. 0a0a:0001 = 10.10.0.1


def _port(sysfs: Path, device: str, port: int, entries: dict[int, tuple[str, str]]) -> None:
    """entries: index -> (GID suffix after ffff:, type)."""
    base = sysfs / device / "ports" / str(port)
    (base / "gids").mkdir(parents=True)
    (base / "gid_attrs" / "types").mkdir(parents=True)
    for index, (suffix, gid_type) in entries.items():
        (base / "gids" / str(index)).write_text(IPV4_GID.format(suffix) + "\n")
        (base / "gid_attrs" / "types" / str(index)).write_text(gid_type + "\n")


@pytest.fixture
def sysfs(tmp_path) -> Path:
    root = tmp_path / "infiniband"
    # 10.10.0.1 = 0a0a:0001: index 0 is RoCE v1, index 3 RoCE v2; another IP at index 1.
    _port(
        root,
        "rocep1s0f0",
        1,
        {0: ("0a0a:0001", "IB/RoCE v1"), 1: ("c0a8:0001", "RoCE v2"), 3: ("0a0a:0001", "RoCE v2")},
    )
    _port(root, "rocep1s0f1", 1, {3: ("0a0a:0001", "RoCE v2"), 5: ("0a0a:0001", "RoCE v2")})
    _port(root, "roceP2p1s0f1", 1, {7: ("0a0a:0001", "RoCE v2")})
    return root


def test_selector_grammar():
    assert parse_hca_selector("mlx5_0") == (False, False, [("mlx5_0", None)])
    assert parse_hca_selector("^=mlx5_0:1,mlx5_1") == (
        True,
        True,
        [("mlx5_0", 1), ("mlx5_1", None)],
    )
    for bad in ("", "=", "mlx5_0:x", "mlx5 0", "a,,b"):
        with pytest.raises(ValueError, match="is not an NCCL_IB_HCA selector"):
            parse_hca_selector(bad)


def test_resolves_the_roce_v2_gid_of_the_node_address(sysfs):
    assert resolve_gid_index("=rocep1s0f0", "10.10.0.1", sysfs) == 3
    assert resolve_gid_index("=roceP2p1s0f1:1", "10.10.0.1", sysfs) == 7


def test_multi_hca_selector_intersects_the_selected_ports(sysfs):
    assert resolve_gid_index("=rocep1s0f0,rocep1s0f1", "10.10.0.1", sysfs) == 3
    # prefix match selects all three devices; they share no index
    with pytest.raises(ValueError, match="share no RoCE v2 GID index"):
        resolve_gid_index("roce", "10.10.0.1", sysfs)
    assert resolve_gid_index("^=roceP2p1s0f1", "10.10.0.1", sysfs) == 3  # exclusion


def test_no_usable_gid_is_an_error(sysfs):
    with pytest.raises(ValueError, match=r"rocep1s0f0 port 1 has no RoCE v2 GID for 10\.10\.0\.9"):
        resolve_gid_index("=rocep1s0f0", "10.10.0.9", sysfs)
    with pytest.raises(ValueError, match="no InfiniBand device"):
        resolve_gid_index("mlx5", "10.10.0.1", sysfs)


def _as_remote_script(module_file: str, *args: str) -> tuple[int, dict]:
    """Run a probe like the launcher does over ssh: source on stdin (with the project module it
    imports, as `Shell.run_script` ships it), no package on the path."""
    done = subprocess.run(
        [sys.executable, "-I", "-", *args],
        input=bundled(Path(module_file)),
        capture_output=True,
        text=True,
        cwd="/",
    )
    return done.returncode, json.loads(done.stdout)


def test_gid_probe_runs_standalone(sysfs):
    assert _as_remote_script(gid.__file__, "=rocep1s0f1", "10.10.0.1", str(sysfs)) == (
        0,
        {"gid_index": 3},
    )
    rc, answer = _as_remote_script(gid.__file__, "=rocep1s0f1", "10.10.0.2", str(sysfs))
    assert rc == 1 and "no RoCE v2 GID for 10.10.0.2" in answer["error"]


def test_snapshot_probe(tmp_path):
    fake_snapshot(tmp_path, "org/m", "c" * 40)
    assert (
        _as_remote_script(node_probe.__file__, "snapshot", str(tmp_path), "org/m", "c" * 40)[0] == 0
    )
    rc, answer = _as_remote_script(
        node_probe.__file__, "snapshot", str(tmp_path), "org/m", "d" * 40
    )
    assert rc == 1 and "config.json is missing" in answer["detail"]
    snapshot = next(tmp_path.rglob("snapshots")) / ("c" * 40)
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(index))
    (snapshot / "model-00001-of-00002.safetensors").write_bytes(b"\0")
    assert node_probe.snapshot_problem(tmp_path, "org/m", "c" * 40) == (
        f"{snapshot} lacks 1 of 2 shards, first model-00002-of-00002.safetensors"
    )


def test_snapshot_probe_names_special_files(tmp_path):
    """A FIFO as config.json must not hang the probe, nor be reported missing."""
    fake_snapshot(tmp_path, "org/m", "c" * 40)
    snapshot = next(tmp_path.rglob("snapshots")) / ("c" * 40)
    (snapshot / "config.json").unlink()
    os.mkfifo(snapshot / "config.json")
    rc, answer = _as_remote_script(
        node_probe.__file__, "snapshot", str(tmp_path), "org/m", "c" * 40
    )
    assert rc == 1 and answer["detail"] == f"{snapshot}/config.json is a FIFO, not a regular file"
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors.index.json").mkdir()
    assert node_probe.snapshot_problem(tmp_path, "org/m", "c" * 40) == (
        f"{snapshot}/model.safetensors.index.json: is a directory, not a regular file"
    )


def test_ports_probe_sees_a_listening_socket():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        rc, answer = _as_remote_script(node_probe.__file__, "ports", "127.0.0.1", str(port))
        assert rc == 1 and answer["detail"] == f"in use on 127.0.0.1: {port}"
    assert node_probe.busy_ports("127.0.0.1", [port]) == []
