# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Real engines on tiny local checkpoints built here (no download), with and without DSpark, for
the lane the self-test runs for: V1 (this project's proposers) or V2 (upstream's DSpark on Model
Runner V2).

- Qwen3: a bigram Qwen3 target and a DeepSpec-format DSpark draft that partly predicts it, in
  the profile's `--dtype` (default float32, where no rounding can move a greedy choice);
- DeepSeek-V4: a tiny V4 target carrying its `mtp.*` draft, quantised as V4-Flash ships (FP8 e4m3
  linears with ue8m0 block scales, MXFP4 experts), bf16, the context-dependent oracle whose draft
  experts contribute.

Each engine runs in its own process (`engine_run`), with the profile's `draft_sample_method`
(and the DeepSeek-V4 one with its `--moe-backend`). Passed means greedy output with DSpark equals
greedy output without it, token for token; on CUDA also that the drafter captured CUDA graphs and
replayed them while serving, (V1) that every draft step of every batch size it ran, greedy and
in the mixed-temperature pass sampled, replayed a FULL draft graph, and (V1, DeepSeek-V4) that
every captured draft graph drafts what eager drafting does, greedy and, where the graphs replay
sampled drafts, seeded sampled. The capture plan of target and draft is printed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from tools.gpu_selftest.draft_steps import eager_steps
from tools.gpu_selftest.engine_run import EngineSpec, spec_json
from tools.gpu_selftest.report import FAILED, NEEDS_CUDA, PASSED, SKIPPED, Outcome, cuda_available

K = 4
MAX_TOKENS = 32
ENGINE_TIMEOUT_S = 600
PROJECT = Path(__file__).resolve().parents[2]


def qwen3_pair(root: Path) -> tuple[str, str | None, str]:
    """(target, draft, dtype) of the Qwen3 check."""
    from dspark_fixtures.checkpoints import qwen3

    target = qwen3.build_qwen3_target(root / "target", kind="bigram")
    spec = qwen3.DSparkDraftSpec(markov_rank=qwen3.HIDDEN_SIZE)
    weights = qwen3.bigram_dspark_weights(spec, target)
    draft = qwen3.save_dspark_draft(root / "draft", spec, weights, target)
    return str(target), str(draft), ""  # the profile's --dtype


# DeepSeek-V4-Flash's 64 attention heads over the Spark profile's tensor-parallel size 2: each
# Spark rank's head count, which picks the attention kernel's specialisation on CUDA.
V4_HEADS_PER_RANK = 32


def deepseek_v4_config() -> dict:
    from dspark_fixtures.checkpoints.deepseek_v4_quantised import QUANTISED_V4_CONFIG

    return {**QUANTISED_V4_CONFIG, "num_attention_heads": V4_HEADS_PER_RANK}


def deepseek_v4_target(root: Path) -> tuple[str, str | None, str]:
    """(target with its `mtp.*` draft, no separate draft, dtype) of the DeepSeek-V4 check."""
    from dspark_fixtures.checkpoints import deepseek_v4, deepseek_v4_quantised

    config = deepseek_v4_config()
    shipped, _ = deepseek_v4_quantised.quantise_v4_checkpoint(
        deepseek_v4_quantised.moe_oracle_checkpoint(config)
    )
    target = deepseek_v4.save_v4_target(root / "target", shipped, config, keep_dtypes=True)
    return str(target), None, "bfloat16"


def qwen3_prompts() -> list[list[int]]:
    """The demo's prompts as the tiny tokenizer's ids (`w12` is 16)."""
    return [[16, 11, 304, 45, 9], [904 + i for i in range(8)], [5, 6, 7], [504, 46, 46, 46, 11]]


def deepseek_v4_prompts() -> list[list[int]]:
    """Longer than the oracle's period, so that its drafts read the ring and are accepted."""
    from dspark_fixtures.checkpoints.deepseek_v4 import PERIOD, cycle_prompt

    return [cycle_prompt(10 + PERIOD * i, 48 + 8 * i) for i in range(4)]


FAMILIES: dict[str, tuple[Callable[[Path], tuple[str, str | None, str]], Callable]] = {
    "qwen3": (qwen3_pair, qwen3_prompts),
    "deepseek_v4": (deepseek_v4_target, deepseek_v4_prompts),
}


class EngineFailed(Exception):
    """An engine process did not answer; the message is its last error line."""


def run_engine(spec: EngineSpec) -> dict:
    """`engine_run`'s answer for `spec`; EngineFailed with its last error line otherwise."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tools.gpu_selftest.engine_run", spec_json(spec)],
            cwd=PROJECT,
            capture_output=True,
            text=True,
            timeout=ENGINE_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise EngineFailed(f"no answer within {ENGINE_TIMEOUT_S} s") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        errors = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise EngineFailed(errors[-1] if errors else f"exit status {done.returncode}")
    return json.loads(lines[-1])


def skip_reason(family: str, args: argparse.Namespace, on_cuda: bool) -> str | None:
    if args.engines == "off":
        return "--engines off"
    if on_cuda:
        return None
    if args.runner == "v2":
        return f"{NEEDS_CUDA}: Model Runner V2 (upstream's DSpark) runs on CUDA only"
    if family == "deepseek_v4":
        return (
            f"{NEEDS_CUDA}: vLLM's CPU wheel serves DeepSeek-V4 only with Triton (which it lacks) "
            "and its FP8/MXFP4 kernels only with AMX"
        )
    if args.engines == "auto":
        return f"{NEEDS_CUDA} (--engines on runs it on this CPU, without graphs)"
    return None


def first_difference(plain: list[list[int]], dspark: list[list[int]]) -> str | None:
    """Where DSpark's tokens first leave plain vLLM's: the prompt, the position, both tokens."""
    for prompt, (want, got) in enumerate(zip(plain, dspark, strict=True)):
        if want != got:
            at = next(
                (i for i, pair in enumerate(zip(want, got, strict=False)) if len(set(pair)) > 1),
                min(len(want), len(got)),
            )
            return (
                f"prompt {prompt}, token {at}: {want[at : at + 1]} without DSpark, "
                f"{got[at : at + 1]} with it"
            )
    return None


def graph_problems(run: dict, sampled: bool) -> list[str]:
    """What the CUDA-graph side of one DSpark run got wrong; `sampled`: the profile drafts
    probabilistically, so the mixed-temperature pass must have drafted sampled steps."""
    counts = run["graphs"]
    problems = []
    if not counts["draft capture"] or not counts["draft replay"]:
        problems.append(
            f"draft CUDA graphs: {counts['draft capture']} captured, "
            f"{counts['draft replay']} replayed while serving"
        )
    if "draft_steps" in run:
        eager = eager_steps(run["draft_steps"])
        if eager:
            problems.append("drafted without a FULL graph: " + ", ".join(eager))
        variants = {step["variant"] for step in run["draft_steps"]}
        wanted = {"greedy", "sampled"} if sampled else {"greedy"}
        if not wanted <= variants:
            problems.append(f"no {' or '.join(sorted(wanted - variants))} draft steps ran")
    for name in ("greedy_agreement", "sampled_agreement"):
        agreement = run.get(name) or {}
        differing = sorted(int(size) for size, agree in agreement.items() if not agree)
        if differing:
            problems.append(
                f"{name}: graphs for {differing} requests draft other tokens than eager"
            )
    return problems


def plan_summary(plan: dict) -> str:
    target, draft = plan["target"], plan["draft"]
    return f"capture plan: target {target['mode']} {target['sizes']}, draft {draft or 'none'}"


def graph_summary(run: dict) -> str:
    counts = run["graphs"]
    text = (
        f"draft graphs {counts['draft capture']} captured, {counts['draft replay']} replayed; "
        + plan_summary(run["capture_plan"])
    )
    if run.get("draft_steps"):
        full = {
            variant: sorted({s["requests"] for s in run["draft_steps"] if s["variant"] == variant})
            for variant in ("greedy", "sampled")
        }
        text += "; every draft step replayed a FULL graph: " + ", ".join(
            f"{variant} at {sizes} requests" for variant, sizes in full.items() if sizes
        )
    return text


def serve_both(family: str, args: argparse.Namespace) -> tuple[dict, dict]:
    """The family's engine without and with DSpark, on checkpoints built for this run."""
    build, prompts = FAMILIES[family]
    with tempfile.TemporaryDirectory(prefix=f"dspark-selftest-{family}-") as workdir:
        target, draft, dtype = build(Path(workdir))
        plain, dspark = (
            run_engine(
                EngineSpec(
                    family=family,
                    runner=args.runner,
                    target=target,
                    draft=draft,
                    speculative=speculative,
                    k=K,
                    dtype=dtype or args.dtype,
                    prompts=prompts(),
                    max_tokens=MAX_TOKENS,
                    max_num_seqs=args.max_num_seqs,
                    draft_sample_method=args.draft_sample_method,
                    moe_backend=args.moe_backend if family == "deepseek_v4" else None,
                )
            )
            for speculative in (False, True)
        )
    return plain, dspark


def check_engines(family: str, args: argparse.Namespace) -> Outcome:
    on_cuda = cuda_available()
    reason = skip_reason(family, args, on_cuda)
    if reason:
        return Outcome(SKIPPED, reason)
    lane = args.runner
    try:
        plain, dspark = serve_both(family, args)
    except EngineFailed as error:
        return Outcome(FAILED, f"{lane}: an engine failed: {error}")
    facts = {
        "start_s": {"plain": plain["start_s"], "dspark": dspark["start_s"]},
        "acceptance": round(dspark["accepted"] / max(1, dspark["drafts"] * K), 3),
        "graphs": dspark["graphs"],
        "capture_plan": dspark["capture_plan"],
    }
    difference = first_difference(plain["token_ids"], dspark["token_ids"])
    if difference:
        return Outcome(
            FAILED, f"{lane}: DSpark's greedy output is not plain's: {difference}", facts
        )
    sampled = args.draft_sample_method == "probabilistic"
    problems = graph_problems(dspark, sampled) if on_cuda else []
    if problems:
        return Outcome(FAILED, f"{lane}: " + "; ".join(problems), facts)
    detail = (
        f"{lane}: greedy output equals no speculation ({len(plain['token_ids'])} prompts x "
        f"{MAX_TOKENS} tokens, acceptance {facts['acceptance']:.2f})"
    )
    if not on_cuda:
        plan = plan_summary(dspark["capture_plan"])
        return Outcome(PASSED, f"{detail} on cpu; {plan}; CUDA graphs {NEEDS_CUDA}", facts)
    return Outcome(PASSED, f"{detail}; {graph_summary(dspark)}", facts)
