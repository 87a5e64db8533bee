"""A tiny local Qwen3 model and an in-process CPU vLLM engine that records what it verifies."""

import gc
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dspark_demo import tiny_models


def build_tiny_qwen3(path: Path) -> str:
    """A 2-layer random Qwen3 target with a word-level tokenizer (`w0` ... `w995`)."""
    return str(tiny_models.build_qwen3_target(path))


def cpu_engine_env(stack: ExitStack) -> None:
    """In-process V1 engine on the CPU, offline."""
    monkeypatch = stack.enter_context(pytest.MonkeyPatch.context())
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@dataclass
class EngineRun:
    outputs: list[list[int]]
    steps: list[tuple[dict[str, int], dict[str, list[int]]]] = field(default_factory=list)
    """Per scheduled step: tokens per request, and the drafts scheduled for verification."""
    forward_rows: list[int] = field(default_factory=list)
    """Rows of every target forward pass."""
    metrics: list = field(default_factory=list)
    """`LLM.get_metrics()` at the end of the run."""

    def metric(self, name: str):
        """The one sample of an unlabelled metric."""
        (sample,) = [m for m in self.metrics if m.name == name]
        return sample

    def counters_by_position(self, name: str) -> list[int]:
        """A counter labelled by draft position, as a list indexed by position."""
        samples = {int(m.labels["position"]): m.value for m in self.metrics if m.name == name}
        return [samples[pos] for pos in range(len(samples))]


PROMPTS = [" ".join(f"w{(7 * p + 3 * i) % 50 + 5}" for i in range(6 + p)) for p in range(4)]


def run_engine(model: str, speculative_config: dict | None, max_tokens: int = 48) -> EngineRun:
    from vllm import LLM, SamplingParams

    with ExitStack() as stack:
        cpu_engine_env(stack)
        llm = LLM(
            model=model,
            dtype="float32",
            max_model_len=256,
            max_num_seqs=8,
            seed=0,
            enforce_eager=True,
            disable_log_stats=False,
            speculative_config=speculative_config,
        )
        run = EngineRun(outputs=[])
        core = llm.llm_engine.engine_core.engine_core
        schedule = core.scheduler.schedule

        def recording_schedule(*args, **kwargs):
            output = schedule(*args, **kwargs)
            spec = {r: list(t) for r, t in output.scheduled_spec_decode_tokens.items()}
            run.steps.append((dict(output.num_scheduled_tokens), spec))
            return output

        core.scheduler.schedule = recording_schedule
        model_runner = core.model_executor.driver_worker.worker.model_runner
        model_runner.model.register_forward_pre_hook(
            lambda module, args, kwargs: run.forward_rows.append(kwargs["input_ids"].shape[0]),
            with_kwargs=True,
        )
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        run.outputs = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
        run.metrics = llm.get_metrics()
        del llm
        gc.collect()
    return run
