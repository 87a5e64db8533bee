"""Real vLLM CPU engines for the benchmarks: one at a time, greedy, spec counters.

Engines run in-process (no engine subprocesses: about 3 s to start instead of 15).
Only one engine may be alive at a time: each new engine unregisters the previous
one's Prometheus collectors, so its spec-decode counters would go stale.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from pathlib import Path

ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
# vLLM 0.32.0's V1 config names the features it refuses in this message.
_REFUSAL = "Model Runner V1 does not support"


class EngineUnavailable(RuntimeError):
    """vLLM refused the speculative method (e.g. dspark without dspark-vllm)."""


@dataclass
class SpecTotals:
    drafts: int = 0
    accepted: int = 0
    accepted_per_pos: tuple[int, ...] = ()

    def __sub__(self, before: SpecTotals) -> SpecTotals:
        per_pos = tuple(
            a - (before.accepted_per_pos[i] if i < len(before.accepted_per_pos) else 0)
            for i, a in enumerate(self.accepted_per_pos)
        )
        return SpecTotals(self.drafts - before.drafts, self.accepted - before.accepted, per_pos)


@dataclass
class GenerateResult:
    outputs: list[list[int]]
    seconds: float
    spec: SpecTotals

    @property
    def tokens_per_s(self) -> float:
        return sum(len(o) for o in self.outputs) / self.seconds

    @property
    def tau(self) -> float | None:
        """1 + accepted / drafts; vLLM's accepted counter excludes the bonus token."""
        return 1 + self.spec.accepted / self.spec.drafts if self.spec.drafts else None

    @property
    def acceptance_per_pos(self) -> list[float]:
        drafts = self.spec.drafts
        return [a / drafts for a in self.spec.accepted_per_pos] if drafts else []


class Engine:
    """One `vllm.LLM` on a tiny local target, float32, eager, greedy sampling."""

    def __init__(self, target_dir: Path, spec_config: dict | None, max_num_seqs: int) -> None:
        for key, value in ENGINE_ENV.items():
            os.environ.setdefault(key, value)
        from vllm import LLM

        try:
            self.llm = LLM(
                model=str(target_dir),
                dtype="float32",
                max_model_len=256,
                max_num_seqs=max_num_seqs,
                seed=0,
                enforce_eager=True,
                disable_log_stats=False,
                speculative_config=spec_config,
            )
        except Exception as exc:  # pydantic wraps the config refusal
            message = str(exc)
            if _REFUSAL in message:
                reason = message[message.index(_REFUSAL) :].splitlines()[0].split(" [type=")[0]
                raise EngineUnavailable(reason) from None
            raise

    def spec_totals(self) -> SpecTotals:
        totals = SpecTotals()
        for metric in self.llm.get_metrics():
            if metric.name == "vllm:spec_decode_num_drafts":
                totals.drafts += metric.value
            elif metric.name == "vllm:spec_decode_num_accepted_tokens":
                totals.accepted += metric.value
            elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                old = totals.accepted_per_pos
                width = max(len(old), len(metric.values))
                totals.accepted_per_pos = tuple(
                    (old[i] if i < len(old) else 0)
                    + (metric.values[i] if i < len(metric.values) else 0)
                    for i in range(width)
                )
        return totals

    def generate(self, prompts: list[list[int]], max_tokens: int) -> GenerateResult:
        """All prompts submitted at once: concurrency = len(prompts) (<= max_num_seqs)."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        before = self.spec_totals()
        started = time.perf_counter()
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        spec = self.spec_totals() - before
        return GenerateResult([list(o.outputs[0].token_ids) for o in outputs], seconds, spec)

    def close(self) -> None:
        del self.llm
        gc.collect()


def run_engine(
    target_dir: Path,
    prompts: list[list[int]],
    max_tokens: int,
    spec_config: dict | None,
    max_num_seqs: int,
) -> GenerateResult:
    """Start an engine, generate once, free it."""
    engine = Engine(target_dir, spec_config, max_num_seqs)
    try:
        return engine.generate(prompts, max_tokens)
    finally:
        engine.close()
