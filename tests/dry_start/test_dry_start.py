# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The dry start on vLLM 0.33.0's Python: every shipped GPU profile starts on the devices it
targets, and a profile vLLM refuses stops with vLLM's own message naming the profile field."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tools.dry_start.engine import Refused, Report, refusal
from tools.dry_start.table import DEVICES

REPO = Path(__file__).resolve().parents[2]
PROFILES = REPO / "recipe" / "profiles"
SPARK = "deepseek-v4-flash-2x-spark"

# The attention class vLLM builds for each device's capability family.
ATTENTION = {
    "deepseek-v4-flash-2x-spark": {"12": "DeepseekV4FlashInferSM120Attention"},
    "deepseek-v4-flash-b200": {"10": "DeepseekV4FlashMLAAttention"},
    "qwen3-8b-dspark-blackwell": {"10": "Attention", "12": "Attention"},
}


def targets() -> list[tuple[str, str]]:
    """Every shipped GPU profile on every table device of a capability it lists: the Spark one on
    GB10, the Blackwell ones on each capability the Blackwell image targets."""
    pairs = []
    for path in sorted(PROFILES.glob("*.yaml")):
        capabilities = yaml.safe_load(path.read_text()).get("compute_capability", [])
        for name, device in sorted(DEVICES.items()):
            if "{}.{}".format(*device.capability) in capabilities:
                pairs.append((path.stem, name))
    return pairs


def decisions(report: dict) -> dict[tuple[str, str], str]:
    return {(d["step"], d["name"]): d["value"] for d in report["decisions"]}


def test_every_blackwell_capability_has_a_profile():
    covered = {DEVICES[device].capability for _, device in targets()}
    assert covered == {(12, 1), (10, 0), (10, 3), (12, 0)}


@pytest.mark.multiproc
@pytest.mark.parametrize(("profile", "device"), targets())
def test_shipped_profile_starts_on_its_device(dry_start, profile, device):
    rc, _, report = dry_start("--profile", profile, "--device", device, "--json")
    assert rc == 0 and report["ok"], report["refusal"]
    made = decisions(report)
    assert {step for step, _ in made} >= {
        "config",
        "model",
        "draft",
        "memory",
        "kv cache",
        "graphs",
    }
    assert made[("config", "vllm")] == "0.33.0"
    attention = ATTENTION[profile][str(DEVICES[device].capability[0])]
    assert any(name.startswith(f"attention {attention} x") for _, name in made), sorted(made)
    max_model_len = (
        f"{yaml.safe_load((PROFILES / f'{profile}.yaml').read_text())['max_model_len']:,}"
    )
    # The KV budget holds at least one request of max_model_len tokens.
    assert float(made[("kv cache", f"max concurrency at {max_model_len} tokens")]) >= 1.0
    # The kernels were read from the image's wheel and vLLM's warm-up walked to its end.
    stopped = ("kernel code not read", "kernel code not checked", "the warm-up walk stopped")
    assert not [w for w in report["warnings"] if w.startswith(stopped)], report["warnings"]
    assert any(s == "graphs" and n.startswith("capture ") for s, n in made), sorted(made)
    assert made[("warm-up", "needs")] == "checked in the image on each node (preflight)"


@pytest.mark.multiproc
def test_spark_decisions_on_gb10(dry_start):
    """What vLLM 0.33.0 decides for the two-node Spark profile on GB10 (sm_121)."""
    _, _, report = dry_start("--profile", SPARK, "--device", "gb10", "--json")
    made = decisions(report)
    assert made[("config", "kv cache dtype")] == "fp8"
    routed = made[("model", "RoutedExperts x43")]
    assert "Mxfp4MoEMethod" in routed and "MARLIN" in routed  # the profile's --moe-backend
    assert "fp8_ds_mla KV" in made[("model", "attention DeepseekV4FlashInferSM120Attention x20")]
    assert made[("draft", "proposer")] == "DSparkRingProposer"
    assert made[("graphs", "cudagraph mode")] == "FULL_AND_PIECEWISE"
    # vLLM's own integrated-GPU rule at the free memory Spark owners report at boot.
    assert made[("memory", "device memory")] == "121.69 GiB"
    for case in ("101.30 GiB free (worst)", "101.80 GiB free (typical)"):
        assert made[("memory", f"at {case}")].startswith("starts, KV budget "), case
        assert "left for the host" in made[("memory", f"at {case}")]
    # The kernels, from the fat binaries of the arm64 image's wheel.
    assert "aarch64" in made[("kernels", "read from")]
    assert made[("kernels", "experts_cls MarlinExperts x89")].startswith("native: vllm/_moe_C")
    fp8 = next(v for (s, n), v in made.items() if n.startswith("fp8_linear DeepGemm"))
    assert fp8.startswith("DeepGEMM: compiled on the node")
    # vLLM's kernel warm-up calls DeepGEMM's, and the model registered TileLang's mHC kernels.
    jit = {n: v for (s, n), v in made.items() if s == "jit"}
    assert any("deep_gemm_warmup" in n and "DeepGEMM JIT" in v for n, v in jit.items()), jit
    assert any("MhcPostTileLangKernel" in n and "TileLang JIT" in v for n, v in jit.items()), jit


@pytest.mark.multiproc
def test_flash_attention_2_is_jit_compiled_on_rtx_pro_6000(dry_start):
    """FlashAttention 2 carries sm_80 code and compute_80 PTX only: on 12.0 the driver compiles
    every attention kernel of the Qwen3 profile from PTX when first used."""
    _, _, report = dry_start(
        "--profile", "qwen3-8b-dspark-blackwell", "--device", "rtx-pro-6000", "--json"
    )
    made = decisions(report)
    assert "x86_64" in made[("kernels", "read from")]
    assert made[("kernels", "attention FLASH_ATTN (FA2) x41")].startswith(
        "JIT from PTX at first use: vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so: 76 modules"
    )


@pytest.mark.multiproc
def test_the_v2_lane_runs_vllms_config_rules(dry_start):
    """Model Runner V2 needs Triton with a CUDA driver: on this CPU the dry start runs V2's
    arguments and config rules, then says what it did not run."""
    rc, _, report = dry_start("--profile", SPARK, "--device", "gb10", "--lane", "v2", "--json")
    assert rc == 0 and report["ok"], report["refusal"]
    assert decisions(report)[("config", "model runner")] == "V2"
    assert "V2 model runner needs Triton" in report["not_run"]


def test_a_report_that_stopped_short_says_so_not_ok():
    """Control: the same report without ``not_run`` ends in ``ok``."""
    report = Report(1, not_run="the V2 model runner needs Triton")
    assert list(report.lines())[-1].startswith("stopped: rank 1 ")
    report.not_run = None
    assert list(report.lines())[-1].startswith("ok: rank 1 ")


def bad_profile(tmp_path: Path, name: str, **changes) -> Path:
    profile = yaml.safe_load((PROFILES / f"{SPARK}.yaml").read_text())
    serve_args = changes.pop("serve_args", [])
    profile["serve_args"] = [
        arg for arg in profile["serve_args"] if arg.split("=")[0] not in dict(serve_args)
    ] + [f"{flag}={value}" for flag, value in serve_args]
    profile.update(changes)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(profile, sort_keys=False))
    return path


REFUSED = {
    # The KV-cache dtype of the public two-node DGX Spark recipe for DeepSeek-V4-Flash: GB10's
    # DeepSeek-V4 attention class refuses it.
    "kv-dtype": (
        {"kv_cache_dtype": "nvfp4_ds_mla"},
        "DeepseekV4 fp8_ds_mla layout only supports fp8 kv-cache, got nvfp4_ds_mla",
        "kv_cache_dtype",
    ),
    # An NVFP4-only MoE backend for the checkpoint's MXFP4 experts.
    "moe-backend": (
        {"serve_args": [("--moe-backend", "flashinfer_b12x")]},
        "flashinfer_b12x",
        "serve_args --moe-backend",
    ),
    # Capture sizes below the widest decode step, 6 requests x (5 + 1) = 36 tokens.
    "capture-size": (
        {"serve_args": [("--compilation-config", '{"cudagraph_capture_sizes": [6, 12, 18, 24]}')]},
        "below the widest decode step",
        "serve_args --compilation-config",
    ),
}


@pytest.mark.multiproc
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_profile_stops_with_vllms_message_as_the_last_line(dry_start, tmp_path, case):
    changes, message, field = REFUSED[case]
    profile = bad_profile(tmp_path, case, **changes)
    rc, lines, _ = dry_start("--profile", str(profile), "--device", "gb10", "--rank", "0")
    assert rc == 1
    assert lines[-1].startswith("REFUSED at ") and message in lines[-1], lines[-1]
    named = lines[-1].rsplit("(profile: ", 1)[1].split(";")[0]
    assert field in named, named


@pytest.mark.multiproc
def test_a_draft_plan_made_before_vllms_rounding_is_refused(dry_start, vllm_033):
    """The graph plan is read from the proposer's objects: a proposer that plans from the
    capture sizes before vLLM's spec-decode rounding leaves 3-request batches (18 tokens, a
    target FULL graph) without a draft graph, and the dry start stops there. Control: the same
    profile and device start (`test_shipped_profile_starts_on_its_device`)."""
    result = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("unrounded_draft_plan.py")),
            *("--profile", SPARK, "--device", "gb10", "--rank", "0"),
        ],
        cwd=REPO,
        env={**vllm_033, "PYTHONPATH": f"{vllm_033['PYTHONPATH']}{os.pathsep}{REPO}"},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    last = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 1, result.stderr[-2000:]
    assert last.startswith("REFUSED at graphs: ") and "batches of [3] requests" in last, last
    _, _, report = dry_start("--profile", SPARK, "--device", "gb10", "--json")
    assert decisions(report)[("graphs", "draft FULL (requests)")] == "[1, 2, 3, 4, 6]"


PATHS = {"hf_home": "/srv/hf", "state_dir": "/var/lib/dspark"}
SITE = {
    "mode": "docker",
    "image": "ghcr.io/example/dspark-vllm-spark@sha256:" + "1" * 64,
    "ports": {"api": 8888, "master": 25000},
    "head": {"address": "10.10.0.1", **PATHS},
    "worker": {"ssh": "dgx@spark-b", "address": "10.10.0.2", **PATHS},
}


@pytest.mark.multiproc
def test_default_output_is_both_ranks_summaries_on_the_sites_addresses(dry_start, tmp_path):
    """Without --rank or --json: the summary of each rank of the two-node profile, on the site
    file's addresses, vLLM's logs in files; here both ranks refused by vLLM's memory rule (the
    utilization the profile shipped with, on a GB10 with the lowest free memory reported)."""
    profile = bad_profile(tmp_path, "memory", serve_args=[("--gpu-memory-utilization", "0.835")])
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({**SITE, "profile": str(profile)}))
    site.chmod(0o600)
    rc, lines, _ = dry_start("--profile", str(profile), "--device", "gb10", "--site", str(site))
    assert rc == 1
    assert lines[0].startswith("vLLM's logs: ") and lines[0].count("dspark-dry-start-") == 2
    assert "rank 0: head at 10.10.0.1, master 10.10.0.1:25000" in lines
    assert "rank 1: worker at 10.10.0.2, master 10.10.0.1:25000, over ssh dgx@spark-b" in lines
    serve = [line for line in lines if line.strip().startswith("args  vllm serve:")]
    assert len(serve) == 2 and all("--master-addr 10.10.0.1" in line for line in serve)
    assert "--headless" in serve[1] and "--headless" not in serve[0]
    refused = [line for line in lines if line.startswith("REFUSED at engine: Free memory")]
    assert len(refused) == 2 and lines[-1] == refused[1]
    assert (
        "(101.3/121.69 GiB) on startup is less than desired GPU memory utilization (0.835, "
        in (refused[0])
    )
    assert "(profile: serve_args --gpu-memory-utilization; " in refused[0]
    assert not [line for line in lines if " INFO " in line or " WARNING " in line]  # vLLM's


def test_refusal_names_the_field_vllm_names():
    error = ValueError("Invalid value 'x' for --moe-backend. Expected one of ...\n  more")
    found = refusal(Refused("engine", error))
    assert found.cause == "serve_args --moe-backend"
    assert "\n" not in found.message
