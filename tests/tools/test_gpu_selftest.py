# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""tools/gpu_selftest.py on this CPU host, as CI and the launcher run it, so it cannot rot: the
CUDA checks say "skipped: needs CUDA", the CPU-meaningful ones run, and each of those fails when
what it checks is broken (mutations below)."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SELFTEST = REPO / "tools" / "gpu_selftest.py"


@pytest.fixture(scope="module")
def selftest():
    spec = importlib.util.spec_from_file_location("gpu_selftest", SELFTEST)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report() -> dict:
    """`python3 - --json` with the file on stdin, exactly as `dspark-launch preflight` runs it."""
    done = subprocess.run(
        [sys.executable, "-", "--json"],
        input=SELFTEST.read_text(),
        capture_output=True,
        text=True,
        timeout=600,
        cwd="/",
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, f"one JSON line on stdout:\n{done.stdout}\n{done.stderr[-3000:]}"
    answer = json.loads(lines[0])
    answer["returncode"] = done.returncode
    return answer


def by_name(report: dict) -> dict[str, dict]:
    return {check["name"]: check for check in report["checks"]}


def test_runs_on_cpu_skipping_only_what_needs_cuda(report):
    checks = by_name(report)
    assert report["returncode"] == 0 and report["ok"], report["verdict"]
    assert report["verdict"] == "ok: 3 passed, 4 skipped"
    for name in ("device", "deferred_copy"):
        assert checks[name]["status"] == "skipped" and checks[name]["detail"] == "needs CUDA"
    assert checks["architectures"]["detail"].startswith("needs CUDA")
    assert checks["draft_graphs"]["status"] == "skipped"
    assert (
        "eager path ran on cpu (deepseek_v4 12 steps, qwen3 12 steps)"
        in (checks["draft_graphs"]["detail"])
    )
    assert checks["ring"]["status"] == "passed"
    assert all(check["needs"] for check in report["checks"])


def test_rms_norm_reports_the_cpu_kernel_contract_as_a_fact(report):
    rms_norm = by_name(report)["rms_norm"]
    assert rms_norm["status"] == "passed"
    assert rms_norm["facts"]["contract"] == (
        "cpu: stacked weight not indexed by row (row 0 for every layer)"
    )


def test_draft_state_bytes_at_the_spark_profile_sizes(report):
    state = by_name(report)["draft_state"]
    # (6 + 1 slots) x 128 entries + 1 dump entry, each 3 x 512 bf16 values + two int64.
    assert state["facts"]["bytes"] == (7 * 128 + 1) * (3 * 512 * 2 + 16) == 2_769_936
    assert state["status"] == "passed"


def test_the_ring_check_fails_when_the_ring_writes_rejected_rows(selftest, monkeypatch):
    from vllm.v1.spec_decode.dspark import ring

    args = argparse.Namespace(arch=None, max_num_seqs=6)
    assert selftest.check_ring(args).status == "passed"
    monkeypatch.setattr(ring, "valid_row_mask", lambda qsl, rows, num_valid: rows >= 0)
    outcome = selftest.check_ring(args)
    assert outcome.status == "failed" and "differs from the plain-loop reference" in outcome.detail


def test_the_rms_norm_fact_follows_the_kernel(selftest, monkeypatch):
    """A kernel that indexes the stacked weight by row is reported as such; one that matches
    neither a per-layer loop nor row 0 fails the check."""
    import torch

    from vllm import _custom_ops as ops

    def per_row(out, x, weight, eps):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        normed = x.float() * torch.rsqrt(variance + eps)
        if weight.dim() == 2:  # [L, head_dim] against [L, ..., head_dim]: row l for layer l
            weight = weight.view(weight.shape[0], *[1] * (x.dim() - 2), weight.shape[1])
        out.copy_((normed * weight.float()).to(out.dtype))

    args = argparse.Namespace(arch=None, max_num_seqs=6)
    monkeypatch.setattr(ops, "rms_norm", per_row)
    assert selftest.check_rms_norm(args).facts["contract"] == ("cpu: stacked weight indexed by row")
    monkeypatch.setattr(ops, "rms_norm", lambda out, x, weight, eps: out.copy_(x))
    assert selftest.check_rms_norm(args).status == "failed"


def test_any_failed_check_makes_the_exit_status_nonzero(selftest, monkeypatch, capsys):
    def broken(args):
        return selftest.Outcome(selftest.FAILED, "broken on purpose")

    checks = tuple(
        selftest.Check(c.name, c.needs, broken) if c.name == "draft_state" else c
        for c in selftest.CHECKS
    )
    monkeypatch.setattr(selftest, "CHECKS", checks)
    assert selftest.main(["--json"]) == 1
    answer = json.loads(capsys.readouterr().out)
    assert answer["ok"] is False and answer["verdict"].startswith("FAILED: draft_state")


@pytest.mark.parametrize(
    ("sass", "ptx", "device", "verdict"),
    [
        (["sm_120"], [], (12, 1), "sass"),  # plain sm_120 code runs on sm_121
        (["sm_120a"], [], (12, 1), "none"),  # arch-specific: exactly 12.0
        (["sm_121a"], [], (12, 1), "sass"),
        (["sm_120f"], [], (12, 1), "sass"),  # family code
        (["sm_100", "sm_120"], ["compute_90"], (12, 1), "sass"),
        (["sm_100"], ["compute_90"], (12, 1), "ptx-jit"),
        (["sm_100"], ["compute_120a"], (12, 1), "none"),
        (["sm_100a"], [], (10, 3), "none"),  # B300 needs its own entry
        (["sm_90"], [], (12, 1), "none"),  # machine code never crosses a major version
        ([], [], (12, 1), "none"),
    ],
)
def test_arch_verdicts_follow_cudas_compatibility_rules(selftest, sass, ptx, device, verdict):
    assert selftest.arch_verdict(sass, ptx, device) == verdict


def test_cuobjdump_listings_are_parsed(selftest):
    elf = (
        "ELF file    1: fmha_sm90_kernel.1.sm_90a.cubin\n"
        "ELF file    2: _C.2.sm_120.cubin\n"
        "ELF file    3: _C.3.sm_100f.cubin\n"
    )
    assert selftest.parse_cuobjdump(elf) == ["sm_100f", "sm_120", "sm_90a"]
    assert selftest.parse_cuobjdump("PTX file    1: _C.1.sm_90.ptx\n") == ["sm_90"]
    assert selftest.parse_cuobjdump("cuobjdump info    : File '_C.so' has no CUDA code\n") == []


def test_nothing_cuda_only_is_imported_at_module_level():
    tree = ast.parse(SELFTEST.read_text())
    top = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    roots = {
        (alias.name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
        for node in top
        for alias in node.names
    }
    assert roots <= set(sys.stdlib_module_names) | {"__future__"}, roots
