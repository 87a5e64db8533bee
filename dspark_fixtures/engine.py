# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The tiny-engine harness: a real in-process vLLM CPU engine over tiny local models.

One harness for the tests, the demo and the benchmarks. Engines run in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): about 3 s to start instead of 15, and
the model runner lives in the caller's process, where tests and benchmarks can
reach the drafter. Only one engine may be alive at a time: a new engine
unregisters the previous one's Prometheus collectors, so its counters go stale.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
# KV blocks of 32 tokens are the smallest the CPU attention backend accepts.
ENGINE_DEFAULTS: dict[str, Any] = dict(
    dtype="float32",
    max_model_len=256,
    seed=0,
    enforce_eager=True,
    disable_log_stats=False,
    block_size=32,
)
# vLLM 0.32.0's V1 config names the features it refuses in this message.
_REFUSAL = "Model Runner V1 does not support"


def use_engine_env() -> None:
    """Set the engine environment (before vllm is first imported); values
    already set, e.g. a larger ``VLLM_CPU_KVCACHE_SPACE``, win."""
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)


@contextlib.contextmanager
def worker_threads_bound(tensor_parallel_size: int) -> Iterator[None]:
    """While workers start, give each tensor-parallel CPU worker its share of
    this process's CPUs.

    vLLM's automatic binding wants a NUMA node per worker (``Not enough allowed
    NUMA nodes to bind threads of 2 local CPUWorkers``); a one-node box splits
    its CPUs instead. A binding the caller set wins; the variable is restored
    after, so that later single-process engines keep every CPU."""
    name = "VLLM_CPU_OMP_THREADS_BIND"
    if tensor_parallel_size == 1 or name in os.environ:
        yield
        return
    cpus = sorted(os.sched_getaffinity(0))
    if tensor_parallel_size > len(cpus):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs as many CPUs")
    share = len(cpus) // tensor_parallel_size
    groups = [cpus[rank * share : (rank + 1) * share] for rank in range(tensor_parallel_size)]
    os.environ[name] = "|".join(",".join(map(str, group)) for group in groups)
    try:
        yield
    finally:
        del os.environ[name]


class EngineUnavailable(RuntimeError):
    """vLLM refused the speculative method (e.g. dspark without dspark-vllm)."""


def dspark_config(draft: Path, k: int = 4, **fields: Any) -> dict[str, Any]:
    """A DSpark speculative config; ``fields`` are further SpeculativeConfig fields."""
    return {"method": "dspark", "model": str(draft), "num_speculative_tokens": k, **fields}


@dataclass
class EngineRun:
    """What one ``generate`` call produced and what the engine counted meanwhile."""

    token_ids: list[list[int]]
    """Generated tokens, in prompt order."""
    seconds: float
    metrics: dict[str, Any]
    """Counters from ``LLM.get_metrics()`` by name (per-position ones as
    lists); spec-decode counters are this call's increments."""
    steps: list[tuple[dict[str, int], dict[str, list[int]]]] = field(default_factory=list)
    """With ``record=True``: per scheduled step, tokens per request and the
    drafts scheduled for verification."""
    forward_rows: list[int] = field(default_factory=list)
    """With ``record=True``: rows of every target forward pass."""

    @property
    def accepted_per_position(self) -> list[int]:
        return list(self.metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos", []))

    @property
    def drafts(self) -> int:
        return self.metrics.get("vllm:spec_decode_num_drafts", 0)

    @property
    def tokens_per_s(self) -> float:
        return sum(len(t) for t in self.token_ids) / self.seconds

    @property
    def tau(self) -> float | None:
        """1 + accepted / drafts; vLLM's accepted counter excludes the bonus token."""
        accepted = self.metrics.get("vllm:spec_decode_num_accepted_tokens", 0)
        return 1 + accepted / self.drafts if self.drafts else None


class TinyEngine:
    """One ``vllm.LLM`` on a local target with this harness's defaults."""

    def __init__(
        self,
        target: Path | str,
        speculative_config: dict[str, Any] | None = None,
        record: bool = False,
        **engine_args: Any,
    ) -> None:
        use_engine_env()
        from vllm import LLM

        try:
            with worker_threads_bound(engine_args.get("tensor_parallel_size", 1)):
                self.llm = LLM(
                    model=str(target),
                    speculative_config=speculative_config,
                    **{**ENGINE_DEFAULTS, **engine_args},
                )
        except Exception as exc:  # pydantic wraps the config refusal
            message = str(exc)
            if _REFUSAL in message:
                reason = message[message.index(_REFUSAL) :].splitlines()[0].split(" [type=")[0]
                raise EngineUnavailable(reason) from None
            raise
        self._record = record
        self._steps: list = []
        self._forward_rows: list[int] = []
        if record:
            self._install_recorders()

    @property
    def model_runner(self):
        """The in-process engine's V1 model runner."""
        core = self.llm.llm_engine.engine_core.engine_core
        return core.model_executor.driver_worker.worker.model_runner

    def _install_recorders(self) -> None:
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        schedule = scheduler.schedule

        def recording_schedule(*args, **kwargs):
            output = schedule(*args, **kwargs)
            spec = {r: list(t) for r, t in output.scheduled_spec_decode_tokens.items()}
            self._steps.append((dict(output.num_scheduled_tokens), spec))
            return output

        scheduler.schedule = recording_schedule
        self.model_runner.model.register_forward_pre_hook(
            lambda module, args, kwargs: self._forward_rows.append(kwargs["input_ids"].shape[0]),
            with_kwargs=True,
        )

    def metrics(self) -> dict[str, Any]:
        return metrics_by_name(self.llm.get_metrics())

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        max_tokens: list[int] | int,
        temperature: float = 0.0,
        **sampling: Any,
    ) -> EngineRun:
        """All prompts submitted at once (strings or token-id lists); ``sampling`` is further
        ``SamplingParams`` fields (``ignore_eos`` defaults to True)."""
        from vllm import SamplingParams

        if isinstance(max_tokens, int):
            max_tokens = [max_tokens] * len(prompts)
        fields = {"seed": 0, "ignore_eos": True, **sampling}
        params = [
            SamplingParams(temperature=temperature, max_tokens=n, **fields) for n in max_tokens
        ]
        inputs = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
        self._steps, self._forward_rows = [], []
        before = self.metrics()
        started = time.perf_counter()
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        return EngineRun(
            [list(o.outputs[0].token_ids) for o in outputs],
            seconds,
            counter_increments(self.metrics(), before),
            self._steps,
            self._forward_rows,
        )

    def generate_stepwise(
        self,
        prompts: list[list[int]],
        max_tokens: list[int],
        abort: dict[int, int] | None = None,
    ) -> EngineRun:
        """Greedy, stepping the engine by hand so that requests can be aborted:
        ``abort`` maps a prompt index to the number of generated tokens after
        which it is aborted (its tokens are what it had by then). All prompts
        are queued at once, so more prompts than ``max_num_seqs`` wait."""
        from vllm import SamplingParams

        engine = self.llm.llm_engine
        before = self.metrics()
        started = time.perf_counter()
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
        seconds = time.perf_counter() - started
        token_ids = [tokens.get(index, []) for index in range(len(prompts))]
        return EngineRun(token_ids, seconds, counter_increments(self.metrics(), before))

    def close(self) -> None:
        # Stops tensor-parallel worker processes now rather than at garbage collection.
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()

    def __enter__(self) -> TinyEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def run_engine(
    target: Path | str,
    prompts: list[str] | list[list[int]],
    max_tokens: list[int] | int,
    speculative_config: dict[str, Any] | None = None,
    temperature: float = 0.0,
    record: bool = False,
    **engine_args: Any,
) -> EngineRun:
    """Generate with a fresh engine and free it before returning."""
    with TinyEngine(target, speculative_config, record=record, **engine_args) as engine:
        return engine.generate(prompts, max_tokens, temperature)


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


def counter_increments(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """``after`` with the spec-decode counters reduced to what happened since ``before``."""
    result = dict(after)
    for name, value in after.items():
        old = before.get(name)
        if not name.startswith("vllm:spec_decode") or old is None:
            continue
        if isinstance(value, list):
            result[name] = [v - (old[i] if i < len(old) else 0) for i, v in enumerate(value)]
        elif isinstance(value, int | float):
            result[name] = value - old
    return result


def read_draft_log(
    path: Path, rank: int = 0, first: bool = False
) -> dict[str, dict[int, dict[str, Any]]]:
    """One tensor-parallel rank's ``dspark_draft_log`` records by request
    (prompt index) and anchor position. The engine suffixes request ids
    (``"3-9a1b"``); the prefix is the prompt's index in the ``generate`` call. Start records
    (one per process that opened the log) are skipped.

    An anchor logged twice keeps its last record, or with ``first`` its first: a preempted
    request's resumed prefill drafts again from anchors it decoded from before, and the
    scheduler discards drafts of a partial prefill, so the first record is the one verified."""
    by_request: dict[str, dict[int, dict[str, Any]]] = collections.defaultdict(dict)
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") != "start" and record["rank"] == rank:
            records = by_request[record["req_id"].rsplit("-", 1)[0]]
            if not (first and record["anchor"] in records):
                records[record["anchor"]] = record
    return by_request


def drafts_one_by_one(
    target: Path,
    draft: Path,
    prompts: list[str],
    max_tokens: list[int],
    log: Path,
    **engine_args: Any,
) -> list[dict[int, dict[str, Any]]]:
    """Each prompt served on its own, one after another in one engine: its draft-log records
    by anchor (``log`` is rewritten for each)."""
    drafts = []
    with TinyEngine(target, dspark_config(draft, dspark_draft_log=str(log)), **engine_args) as e:
        for prompt, tokens in zip(prompts, max_tokens, strict=True):
            log.unlink(missing_ok=True)
            e.generate([prompt], tokens)
            (records,) = read_draft_log(log).values()
            drafts.append(records)
    return drafts


def draft_steps(path: Path, rank: int = 0) -> dict[str, dict[int, dict[str, Any]]]:
    """``read_draft_log`` less what differs between runs and ranks (the request-id
    suffix, the rank): what two runs that drafted alike have in common."""
    return {
        request: {
            anchor: {key: value for key, value in record.items() if key not in ("req_id", "rank")}
            for anchor, record in records.items()
        }
        for request, records in read_draft_log(path, rank).items()
    }
