"""Run a real vLLM engine and read what it reports."""

import collections
import gc
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Engine settings shared by every test; KV blocks of 32 tokens are the smallest
# the CPU attention backend accepts.
ENGINE_DEFAULTS: dict[str, Any] = dict(
    dtype="float32",
    max_model_len=256,
    seed=0,
    enforce_eager=True,
    disable_log_stats=False,
    block_size=32,
)


@dataclass
class EngineRun:
    token_ids: list[list[int]]
    """Generated tokens, in prompt order."""
    metrics: dict[str, Any]
    """Counters from ``LLM.get_metrics()`` by name."""

    @property
    def accepted_per_position(self) -> list[int]:
        return list(self.metrics["vllm:spec_decode_num_accepted_tokens_per_pos"])


def dspark_config(draft: Path, k: int = 4, **options: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"method": "dspark", "model": str(draft), "num_speculative_tokens": k}
    if options:
        config["dspark_options"] = options
    return config


def run_engine(
    target: Path,
    prompts: list[str],
    max_tokens: list[int] | int,
    speculative_config: dict[str, Any] | None = None,
    temperature: float = 0.0,
    sampling: list[dict[str, Any]] | None = None,
    **engine_args: Any,
) -> EngineRun:
    """Generate with a fresh engine and free it before returning.

    ``sampling`` holds per-prompt SamplingParams overrides (top_k, top_p, ...)."""
    from vllm import LLM, SamplingParams

    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    llm = LLM(
        model=str(target),
        speculative_config=speculative_config,
        **{**ENGINE_DEFAULTS, **engine_args},
    )
    try:
        overrides = sampling or [{}] * len(prompts)
        params = [
            SamplingParams(
                **{"temperature": temperature, "seed": 0, **extra}, max_tokens=n, ignore_eos=True
            )
            for n, extra in zip(max_tokens, overrides, strict=True)
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        metrics = metrics_by_name(llm.get_metrics())
        return EngineRun([list(o.outputs[0].token_ids) for o in outputs], metrics)
    finally:
        del llm
        gc.collect()


def read_draft_log(path: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """Draft log records by request (prompt index) and anchor position.

    The engine suffixes request ids (``"3-9a1b"``); the prefix is the prompt's
    index in the ``generate`` call."""
    by_request: dict[str, dict[int, dict[str, Any]]] = collections.defaultdict(dict)
    for line in path.read_text().splitlines():
        record = json.loads(line)
        by_request[record["req_id"].rsplit("-", 1)[0]][record["anchor"]] = record
    return by_request


def metrics_by_name(metrics) -> dict[str, Any]:
    """Values by metric name; per-position counters (a ``position`` label)
    become one list in position order, like vLLM's accepted-per-position vector."""
    values: dict[str, Any] = {}
    positions: dict[str, dict[int, Any]] = collections.defaultdict(dict)
    for metric in metrics:
        value = getattr(metric, "value", getattr(metric, "values", None))
        if "position" in metric.labels:
            positions[metric.name][int(metric.labels["position"])] = value
        else:
            values[metric.name] = value
    for name, by_position in positions.items():
        values[name] = [by_position[p] for p in sorted(by_position)]
    return values
