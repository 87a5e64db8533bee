"""Drive a real vLLM engine step by step over token-id prompts, with aborts; read its counters."""

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.engine.engine_harness import metrics_by_name

V4_ENGINE_DEFAULTS: dict[str, Any] = dict(
    dtype="bfloat16",
    max_model_len=1024,
    seed=0,
    enforce_eager=True,
    disable_log_stats=False,
)


def dspark(k: int = 4, **options: Any) -> dict[str, Any]:
    """DSpark with the draft read from the target checkpoint's own ``mtp.*`` tensors."""
    config: dict[str, Any] = {"method": "dspark", "num_speculative_tokens": k}
    if options:
        config["dspark_options"] = options
    return config


@dataclass
class V4Run:
    token_ids: dict[int, list[int]]
    """Generated tokens by prompt index (aborted prompts: what they had when aborted)."""
    metrics: dict[str, Any]

    @property
    def drafted(self) -> int:
        return self.metrics.get("vllm:spec_decode_num_draft_tokens", 0)

    @property
    def accepted(self) -> int:
        return self.metrics.get("vllm:spec_decode_num_accepted_tokens", 0)


def run_v4(
    target: Path,
    prompts: list[list[int]],
    max_tokens: list[int],
    speculative_config: dict[str, Any] | None = None,
    abort: dict[int, int] | None = None,
    **engine_args: Any,
) -> V4Run:
    """Generate greedily; ``abort`` maps a prompt index to the number of generated tokens after
    which it is aborted. All prompts are queued at once, so more prompts than ``max_num_seqs``
    wait for free slots."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(target),
        speculative_config=speculative_config,
        **{**V4_ENGINE_DEFAULTS, **engine_args},
    )
    try:
        engine = llm.llm_engine
        for index, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
        tokens: dict[int, list[int]] = {}
        pending = dict(abort or {})
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens[int(output.request_id)] = list(output.outputs[0].token_ids)
            due = [i for i, after in pending.items() if len(tokens.get(i, ())) >= after]
            if due:
                engine.abort_request([str(index) for index in due])
                for index in due:
                    del pending[index]
        return V4Run(tokens, metrics_by_name(llm.get_metrics()))
    finally:
        del llm
        gc.collect()
