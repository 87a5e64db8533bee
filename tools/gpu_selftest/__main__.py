# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""GPU self-test of a DSpark vLLM install: what the CPU test suite cannot prove, in one command.

Run it from the project root with the Python of the vLLM that serves: `python -m tools.gpu_selftest`
(inside the image on each node, `dspark-launch preflight` runs `python3 -m tools.gpu_selftest
--json` there). Every check names what it needs; on a host without CUDA the CUDA checks report
"skipped: needs CUDA" and the rest run, so CI runs it too (tests/tools/). Exit status: 0 when every
check passed on a CUDA device; 1 when a check failed; 3 when nothing failed but there was no CUDA
device, so nothing was proved on a GPU (the verdict says so). `--runner v2` checks upstream's
DSpark on Model Runner V2 instead of this project's V1 proposers. The engines start as the
serving profile does: its `--draft-sample-method`, `--moe-backend` and `--dtype`.

Checks (one module each):
- device: name, compute capability, memory (needs CUDA);
- architectures: the machine code and PTX that torch, vLLM's core and MoE extensions (found by
  role in vLLM's RECORD) and FlashInfer carry, against the device's (or `--arch`) architecture;
- ring: DSpark's context-ring step on random ragged batches (V1);
- deferred_copy: a host-to-device copy consumed one step later, from fresh pinned memory (V1,
  needs CUDA);
- rms_norm: vLLM's `ops.rms_norm` with a stacked `[L, head_dim]` weight, which the Qwen3 draft's
  context K-norm fuses on CUDA: row 0 for every layer fails on CUDA;
- markov_chain: the fused Markov kernels at the Qwen3-8B draft's size against the torch chain,
  the one-launch chain's start-up check, and the time of each per chain (V1, needs CUDA);
- draft_state: the DeepSeek-V4 ring's bytes at the serving profile's sizes (V1);
- engine_qwen3, engine_deepseek_v4: real engines on tiny local checkpoints, with and without
  DSpark: lossless, and on CUDA draft CUDA graphs captured, replayed and equal to eager drafting,
  with the capture plan of target and draft.
Nothing CUDA-only is imported at module level.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import sys
import traceback

from tools.gpu_selftest import engines
from tools.gpu_selftest.architectures import check_architectures, check_device
from tools.gpu_selftest.deferred_copy import check_deferred_copy
from tools.gpu_selftest.draft_state import SPARK_MAX_NUM_SEQS, check_draft_state
from tools.gpu_selftest.markov_chain import check_markov_chain
from tools.gpu_selftest.report import (
    FAILED,
    NEEDS_CUDA,
    PASSED,
    SKIPPED,
    Check,
    Outcome,
    cuda_available,
)
from tools.gpu_selftest.ring import check_ring
from tools.gpu_selftest.rms_norm import check_rms_norm

CHECKS = (
    Check("device", "cuda", check_device, cuda_only=True),
    Check("architectures", "cuda (or --arch)", check_architectures),
    Check("ring", "cpu; cuda for the device comparison", check_ring, v1_only=True),
    Check("deferred_copy", "cuda", check_deferred_copy, cuda_only=True, v1_only=True),
    Check("rms_norm", "vllm's _C (cpu or cuda)", check_rms_norm),
    Check("markov_chain", "cuda", check_markov_chain, cuda_only=True, v1_only=True),
    Check("draft_state", "cpu or cuda", check_draft_state, v1_only=True),
    Check(
        "engine_qwen3",
        "cuda (cpu with --engines on: no graphs)",
        functools.partial(engines.check_engines, "qwen3"),
    ),
    Check("engine_deepseek_v4", "cuda", functools.partial(engines.check_engines, "deepseek_v4")),
)


def run_check(check: Check, args: argparse.Namespace, has_cuda: bool) -> Outcome:
    if check.v1_only and args.runner == "v2":
        return Outcome(SKIPPED, "V1 lane only (--runner v2 serves upstream's DSpark)")
    if check.cuda_only and not has_cuda:
        return Outcome(SKIPPED, NEEDS_CUDA)
    if check.name == "architectures" and not has_cuda and not args.arch:
        return Outcome(SKIPPED, f"{NEEDS_CUDA} (or --arch sm_XY)")
    try:
        # vLLM logs to stdout; the report owns it.
        with contextlib.redirect_stdout(sys.stderr):
            return check.run(args)
    except Exception as e:
        return Outcome(FAILED, f"{type(e).__name__}: {e}", {"traceback": traceback.format_exc()})


def run_checks(args: argparse.Namespace) -> list[dict]:
    has_cuda = cuda_available()
    results = []
    for check in CHECKS:
        outcome = run_check(check, args, has_cuda)
        results.append(
            {
                "name": check.name,
                "needs": check.needs,
                "status": outcome.status,
                "detail": outcome.detail,
                "facts": outcome.facts,
            }
        )
    return results


# The exit status when nothing failed on a host without CUDA: nothing was proved on a GPU.
NO_GPU = 3


def verdict(results: list[dict], has_cuda: bool = True) -> str:
    failed = [r["name"] for r in results if r["status"] == FAILED]
    passed = sum(r["status"] == PASSED for r in results)
    skipped = sum(r["status"] == SKIPPED for r in results)
    if failed:
        return f"FAILED: {', '.join(failed)} ({passed} passed, {skipped} skipped)"
    if not has_cuda:
        return (
            f"NO GPU: nothing proved on a GPU ({passed} passed on this CPU, {skipped} skipped); "
            "run it where the GPU is"
        )
    return f"ok: {passed} passed, {skipped} skipped"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.gpu_selftest", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--arch", help="check the binaries against this architecture (sm_121)")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=SPARK_MAX_NUM_SEQS,
        help="the serving profile's: the draft-state bytes, the engines' batch",
    )
    parser.add_argument(
        "--draft-sample-method",
        choices=("probabilistic", "greedy"),
        default="probabilistic",
        help="the serving profile's speculative.draft_sample_method",
    )
    parser.add_argument(
        "--moe-backend", help="the serving profile's --moe-backend (the DeepSeek-V4 engine's)"
    )
    parser.add_argument(
        "--dtype", default="float32", help="the serving profile's dtype (the Qwen3 engine's)"
    )
    parser.add_argument(
        "--runner",
        choices=("v1", "v2"),
        default="v1",
        help="the lane served: v1 (this project's DSpark proposers) or v2 (upstream's DSpark)",
    )
    parser.add_argument(
        "--engines",
        choices=("auto", "on", "off"),
        default="auto",
        help="the engine checks: auto runs them with CUDA only, on also on a CPU",
    )
    return parser.parse_args(argv)


def missing_packages() -> list[str]:
    """What the checks import that this Python lacks: the self-test runs on the serving vLLM."""
    return [name for name in ("torch", "vllm") if importlib.util.find_spec(name) is None]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = missing_packages()
    if missing:
        print(
            f"gpu self-test: {sys.executable} has no {' and no '.join(missing)}: run it with the "
            "Python of the vLLM that will serve (the image's python3, or that venv's "
            "bin/python).",
            file=sys.stderr,
        )
        return 2
    results = run_checks(args)
    has_cuda = cuda_available()
    failed = any(r["status"] == FAILED for r in results)
    report = {
        "ok": has_cuda and not failed,
        "gpu": has_cuda,
        "verdict": verdict(results, has_cuda),
        "runner": args.runner,
        "checks": results,
    }
    if args.json:
        print(json.dumps(report))
    else:
        for r in results:
            print(f"{r['status']:>7}  {r['name']:<18} {r['detail']}")
        print(report["verdict"])
    return 1 if failed else 0 if has_cuda else NO_GPU


if __name__ == "__main__":
    sys.exit(main())
