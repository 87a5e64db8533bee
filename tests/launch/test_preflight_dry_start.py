# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Preflight runs the dry start (`python -m tools.dry_start.engine`) in each node's image with
that rank's own `vllm serve` arguments and environment; a refusal on either node stops `start`
before any rank runs, with vLLM's reason printed per node."""

from __future__ import annotations

from tests.launch.launch_testlib import write_profile

REFUSAL = {
    "step": "engine",
    "message": "DeepseekV4 fp8_ds_mla layout only supports fp8 kv-cache, got nvfp4_ds_mla.",
    "cause": "kv_cache_dtype",
    "fix": "change kv_cache_dtype to a value vLLM accepts here (its message above says which)",
}


def dry_starts(fake_cluster) -> dict[str, list[str]]:
    """The arguments of each node's dry start, as the image's Python received them: the module
    of the image's project root, never a file piped in."""
    runs = {}
    for entry in fake_cluster.commands():
        argv = entry["argv"]
        if argv[:2] == ["docker", "run"] and "--rank" in argv:
            at = argv.index("-m")
            assert argv[at + 1] == "tools.dry_start.engine" and "-" not in argv
            assert argv[argv.index("--workdir") + 1] == "/opt/dspark"
            runs[entry["node"]] = argv[at + 2 :]
    return runs


def test_preflight_dry_starts_each_rank_with_its_own_arguments(fake_cluster, cli, tmp_path):
    write_profile(tmp_path / "fake-profile.yaml", env={"HF_HUB_OFFLINE": "1"})
    result = cli("--site", fake_cluster.site, "preflight")
    assert result.rc == 0, result.err
    assert "head: ok; KV cache 3,020,517 tokens, max concurrency at 1,048,576 tokens 2.88" in (
        result.out
    )
    assert (
        "at 101.30 GiB free (measured): starts, KV budget 18.12 GiB, 3.95 GiB left for the host"
    ) in result.out
    runs = dry_starts(fake_cluster)
    assert sorted(runs) == ["head", "worker"]
    for node, rank in (("head", "0"), ("worker", "1")):
        args = runs[node]
        assert args[:3] == ["--rank", rank, "--json"]
        env = [arg for arg in args[: args.index("--")] if arg.startswith("--env=")]
        # The site file's lane (v1), then the profile's environment, then the image's HF cache.
        assert env == [
            "--env=VLLM_USE_V2_MODEL_RUNNER=0",
            "--env=HF_HUB_OFFLINE=1",
            "--env=HF_HOME=/hf",
        ]
        serve = args[args.index("--") + 1 :]
        assert serve[0] == "org/fake-model"
        assert serve[serve.index("--node-rank") + 1] == rank
        assert ("--headless" in serve) == (node == "worker")


def test_a_refusal_on_one_node_stops_start_with_vllms_reason(fake_cluster, cli):
    fake_cluster.scenario(worker={"dry_start": {"ok": False, "decisions": [], "refusal": REFUSAL}})
    result = cli("--site", fake_cluster.site, "start")
    assert result.rc == 1
    assert (
        "worker (dgx@spark-b): vLLM refused at engine: DeepseekV4 fp8_ds_mla layout only "
        "supports fp8 kv-cache, got nvfp4_ds_mla. (profile: kv_cache_dtype;"
    ) in result.out
    assert "vLLM refuses to start on worker" in result.err.strip().splitlines()[-1]
    assert fake_cluster.docker_runs() == []
