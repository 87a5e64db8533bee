# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""One tiny engine of the engine checks, in a process of its own (a CUDA error or a crash stays in
it): `python -m tools.gpu_selftest.engine_run SPEC_JSON`.

Starts a real vLLM engine in this process (in-process engine core, so that its runner and drafter
can be inspected), counts the CUDA graphs the drafter and the target capture and replay, generates
greedily (and, with DSpark, again with mixed temperatures: greedy and sampled requests in one
batch) and prints one JSON line: the tokens, the spec-decode counters, the graph counts, the
capture plan, on CUDA with the V1 proposers every draft step by batch size and variant with
whether it replayed a FULL graph, and, for the DeepSeek-V4 ring draft on the V1 runner, whether
each captured draft graph drafts what eager drafting does. On CUDA the engine asks for the
memory `memory.py` derives from what vLLM measures free (a GB10 refuses vLLM's default).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass

from tools.gpu_selftest import draft_graphs
from tools.gpu_selftest.draft_steps import DraftSteps
from tools.gpu_selftest.graph_events import GraphEvents
from tools.gpu_selftest.memory import measured_utilization

# KV cache of each tiny engine on CUDA, instead of a share of the device's memory.
KV_CACHE_BYTES = 512 * 2**20
SAMPLED_SEED = 0
# The mixed-temperature pass: every other request samples.
MIXED_TEMPERATURES = (0.0, 0.8)


@dataclass(frozen=True)
class EngineSpec:
    family: str
    """"qwen3" or "deepseek_v4"."""
    runner: str
    """"v1" (this project's proposers) or "v2" (upstream's DSpark on Model Runner V2)."""
    target: str
    draft: str | None
    """The draft checkpoint; None for a draft inside the target (DeepSeek-V4's `mtp.*`)."""
    speculative: bool
    k: int
    dtype: str
    prompts: list[list[int]]
    max_tokens: int
    max_num_seqs: int
    draft_sample_method: str = "probabilistic"
    moe_backend: str | None = None

    def speculative_config(self) -> dict | None:
        if not self.speculative:
            return None
        config = {
            "method": "dspark",
            "num_speculative_tokens": self.k,
            "draft_sample_method": self.draft_sample_method,
        }
        return config if self.draft is None else {**config, "model": self.draft}


def drafter_types(runner: str) -> tuple[type, ...]:
    """The classes whose methods make a CUDA graph the drafter's (see `graph_events`)."""
    if runner == "v2":
        from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

        return (BaseSpeculator,)
    from vllm.v1.spec_decode.dspark.proposer_base import DSparkProposerMixin

    return (DSparkProposerMixin,)


def run(spec: EngineSpec) -> dict:
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if spec.runner == "v2" else "0"
    import torch

    from dspark_fixtures.engine import TinyEngine

    on_cuda = torch.cuda.is_available()
    engine_args: dict = {
        "dtype": spec.dtype,
        "max_model_len": 512,
        "max_num_seqs": spec.max_num_seqs,
        "enforce_eager": not on_cuda,
    }
    if on_cuda:  # vLLM's own block size and graphs; a fixed KV cache
        engine_args |= {
            "block_size": None,
            "kv_cache_memory_bytes": KV_CACHE_BYTES,
            "gpu_memory_utilization": measured_utilization(),
        }
    if spec.moe_backend:
        engine_args["moe_backend"] = spec.moe_backend
    events = GraphEvents(drafter_types(spec.runner))
    recording = events.recording(torch.cuda.CUDAGraph) if on_cuda else contextlib.nullcontext()
    started = time.perf_counter()
    with recording, TinyEngine(spec.target, spec.speculative_config(), **engine_args) as engine:
        start_s = time.perf_counter() - started
        at_start = events.snapshot()
        steps = DraftSteps(events)
        watch = on_cuda and spec.speculative and spec.runner == "v1"
        with steps.watching(engine.model_runner) if watch else contextlib.nullcontext():
            generated = engine.generate(spec.prompts, spec.max_tokens)
            if spec.speculative:
                mixed_temperatures(engine, spec)
        served = events.snapshot()
        result = {
            "token_ids": generated.token_ids,
            "drafts": generated.drafts,
            "accepted": sum(generated.accepted_per_position),
            "start_s": round(start_s, 1),
            "generate_s": round(generated.seconds, 1),
            # Captured while the engine started, replayed while it generated.
            "graphs": {
                name: served[name] - (at_start[name] if name.endswith("replay") else 0)
                for name in served
            },
        }
        if watch:
            result["draft_steps"] = steps.as_json()
        runner = engine.model_runner
        result["capture_plan"] = draft_graphs.capture_plan(runner)
        if on_cuda and spec.speculative and spec.runner == "v1" and spec.family == "deepseek_v4":
            result["greedy_agreement"] = draft_graphs.greedy_agreement(runner.drafter)
            result["sampled_agreement"] = draft_graphs.sampled_agreement(
                runner.drafter, SAMPLED_SEED
            )
    return result


def mixed_temperatures(engine, spec: EngineSpec) -> None:
    """The prompts again, greedy and sampled requests in one batch (seeded)."""
    from vllm import SamplingParams

    params = [
        SamplingParams(
            temperature=MIXED_TEMPERATURES[index % len(MIXED_TEMPERATURES)],
            seed=SAMPLED_SEED + index,
            max_tokens=spec.max_tokens,
            ignore_eos=True,
        )
        for index in range(len(spec.prompts))
    ]
    inputs = [{"prompt_token_ids": prompt} for prompt in spec.prompts]
    engine.llm.generate(inputs, params, use_tqdm=False)


def main(argv: list[str]) -> int:
    spec = EngineSpec(**json.loads(argv[0]))
    with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout; the answer owns it
        result = run(spec)
    print(json.dumps(result), flush=True)
    return 0


def spec_json(spec: EngineSpec) -> str:
    return json.dumps(dataclasses.asdict(spec))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
