# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Preflight's checks before any weights load: the serving flags against vLLM's rules for the
pinned snapshot's config.json (head), and the GPU self-test in the image on both nodes, each
node's verdict printed; `start --skip-selftest` skips only the latter."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from dspark_fixtures.deepseek_v4_flash import V4_FLASH_CONFIG
from tests.launch.launch_testlib import FAKE_REVISION, FakeCluster, write_profile

# DeepSeek-V4-Flash's own expert format (MXFP4) and FP8 linears.
V4_MXFP4_CONFIG = {
    key: V4_FLASH_CONFIG[key]
    for key in (
        "architectures",
        "model_type",
        "n_routed_experts",
        "expert_dtype",
        "quantization_config",
    )
}


def script_runs(cluster: FakeCluster, script_arg: str) -> list[str]:
    """Nodes on which an image Python ran a piped script or a module whose arguments contain
    `script_arg`."""
    return [
        entry["node"]
        for entry in cluster.commands()
        if entry["argv"][:2] == ["docker", "run"]
        and "--interactive" in entry["argv"]
        and script_arg in " ".join(entry["argv"])
    ]


def test_preflight_prints_each_nodes_selftest_verdict(fake_cluster, cli):
    result = cli("--site", fake_cluster.site, "preflight")
    assert result.rc == 0, result.err
    assert "GPU self-test on both nodes" in result.out
    assert "head: ok: 8 passed, 0 skipped" in result.out
    assert "worker (dgx@spark-b): ok: 8 passed, 0 skipped" in result.out
    selftest = "-m tools.gpu_selftest --json --max-num-seqs 4 --runner v1"
    assert script_runs(fake_cluster, selftest) == ["head", "worker"]
    assert script_runs(fake_cluster, "config.json") == ["head"]


def test_a_failed_selftest_stops_start_before_any_rank(fake_cluster, cli):
    report = {
        "ok": False,
        "verdict": "FAILED: architectures (4 passed, 0 skipped)",
        "checks": [
            {"name": "architectures", "status": "failed", "detail": "no code for sm_121 in torch"}
        ],
    }
    fake_cluster.scenario(worker={"selftest": report})
    result = cli("--site", fake_cluster.site, "start")
    assert result.rc == 1
    assert "worker (dgx@spark-b): FAILED: architectures" in result.out
    assert "architectures: no code for sm_121 in torch" in result.out
    assert "GPU self-test failed on worker" in result.err
    assert fake_cluster.docker_runs() == []
    skipped = cli("--site", fake_cluster.site, "start", "--skip-selftest")
    assert skipped.rc == 0, skipped.err
    assert "GPU self-test" not in skipped.out
    assert fake_cluster.docker_runs() == ["worker", "head"]


@pytest.mark.multiproc  # vLLM's own check, imported in a subprocess
def test_serving_flags_vllm_refuses_stop_preflight_with_its_message(fake_cluster, cli, monkeypatch):
    """The real check, run by the fake image with this environment's vLLM, on a config.json
    of MXFP4 experts: the NVFP4-only backend is refused, marlin is accepted."""
    monkeypatch.setenv("FAKE_IMAGE_PYTHON", sys.executable)
    site = yaml.safe_load(fake_cluster.site.read_text())
    snapshot = Path(site["head"]["hf_home"]) / "hub" / "models--org--fake-model" / "snapshots"
    (snapshot / FAKE_REVISION / "config.json").write_text(json.dumps(V4_MXFP4_CONFIG))
    fake_cluster.scenario(head={"run_scripts": True})
    write_profile(Path(site["profile"]), serve_args=["--moe-backend=flashinfer_b12x"])
    result = cli("--site", fake_cluster.site, "start", "--skip-selftest")
    assert result.rc == 1
    assert "serving flags: --moe-backend=flashinfer_b12x is refused" in result.err
    assert "MXFP4 experts by vLLM's map_mxfp4_backend" in result.err
    assert fake_cluster.docker_runs() == []
    write_profile(Path(site["profile"]), serve_args=["--moe-backend=marlin"])
    result = cli("--site", fake_cluster.site, "preflight")
    assert "GPU self-test on both nodes" in result.out  # the flags passed
    # The real self-test, on this CPU, through the pipe: in an image, no GPU stops preflight.
    assert "head: NO GPU: nothing proved on a GPU" in result.out
    assert result.rc == 1 and "GPU self-test failed on head" in result.err
