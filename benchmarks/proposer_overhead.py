"""Proposer overhead per step, excluding the draft model's forward: DSpark vs DFlash.

    .venv/bin/python -m benchmarks.proposer_overhead [--batch-sizes 1 8 32 64] [--k 4]

Runs the real vLLM CPU engine (tiny target, random drafts, greedy) and times
every ``propose()`` call the runner makes, minus the time spent inside the
draft network (both: context K/V precompute, block forward, logits; DSpark
also its Markov head). What remains is the proposer's own bookkeeping: input
preparation, attention metadata, the Markov chain's loop. Only steps where
every request of the batch is decoding are counted (the steady state), after a
warm-up.

It also counts, inside the same steps, the aten ops that wait for the device
on a GPU (``.item()``, ``nonzero``, boolean-mask indexing, ...; see
``dspark_demo/host_syncs.py``). On this CPU those include ops on vLLM's host-side
copies, so a count is an upper bound; zero means the step has none.
"""

import argparse
import contextlib
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from dspark_demo import tiny_models
from dspark_demo.engine import ENGINE_ENV
from dspark_demo.host_syncs import HostSyncRecorder


class ModelTime:
    """Wall time spent inside wrapped draft-model methods (outermost calls only)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0

    def wrap(self, owner: object, name: str) -> None:
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            self._depth += 1
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - start

        setattr(owner, name, timed)


def draft_model_methods(method: str, drafter) -> list[tuple[object, str]]:
    """The draft network's methods; DSpark's (Qwen3, paged) is DFlash's plus
    the Markov chain's heads."""
    model = drafter.model
    methods = [
        (model, "forward"),
        (model, "compute_logits"),
        (model, "precompute_and_store_context_kv"),
        (model, "combine_hidden_states"),
    ]
    if method == "dspark":
        methods += [
            (model, "compute_draft_logits"),
            (model, "markov_embed"),
            (model, "markov_bias"),
        ]
    return methods


@contextlib.contextmanager
def instrumented(method: str, runner, batch_size: int, count_syncs: bool) -> Iterator[list[dict]]:
    """Record total time, draft-model time and (in a separate pass, since the
    recorder slows every op) sync-class ops of each steady-state propose()."""
    drafter = runner.drafter
    model_time = ModelTime()
    for owner, name in draft_model_methods(method, drafter):
        model_time.wrap(owner, name)
    propose: Callable = drafter.propose
    steps: list[dict] = []

    def timed_propose(*args, **kwargs):
        full_decode = (
            len(runner.input_batch.req_ids) == batch_size
            and kwargs.get("num_rejected_tokens_gpu") is not None
        )
        model_time.seconds = 0.0
        recorder = HostSyncRecorder() if count_syncs else contextlib.nullcontext()
        with recorder:
            start = time.perf_counter()
            result = propose(*args, **kwargs)
            total = time.perf_counter() - start
        if full_decode:
            syncs = recorder.syncs if count_syncs else []
            steps.append({"total": total, "model": model_time.seconds, "syncs": syncs})
        return result

    drafter.propose = timed_propose
    try:
        yield steps
    finally:
        drafter.propose = propose


def model_runner(llm):
    """The in-process engine's GPUModelRunner (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    return executor.driver_worker.worker.model_runner


def measure(method: str, target: Path, draft: Path, batch_sizes: list[int], k: int) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(target),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=max(batch_sizes),
        max_num_batched_tokens=max(256, max(batch_sizes) * 16),
        enforce_eager=True,
        speculative_config={"method": method, "model": str(draft), "num_speculative_tokens": k},
    )
    runner = model_runner(llm)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    results = {}
    for batch_size in batch_sizes:
        prompts = [
            {"prompt_token_ids": [5 + (i * 7 + j) % 900 for j in range(8)]}
            for i in range(batch_size)
        ]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up at this batch size
        with instrumented(method, runner, batch_size, count_syncs=False) as steps:
            llm.generate(prompts, params, use_tqdm=False)
        with instrumented(method, runner, batch_size, count_syncs=True) as counted:
            llm.generate(prompts, params, use_tqdm=False)
        sync_ops = sorted({op for step in counted for op in step["syncs"]})
        results[batch_size] = {
            "steps": len(steps),
            "overhead_us": statistics.median(s["total"] - s["model"] for s in steps) * 1e6,
            "propose_us": statistics.median(s["total"] for s in steps) * 1e6,
            "syncs_per_step": statistics.median(len(s["syncs"]) for s in counted),
            "sync_ops": sync_ops,
        }
    del llm
    gc.collect()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    # 64 concurrent requests need more than ENGINE_ENV's 1 GiB of KV cache.
    os.environ.update({**ENGINE_ENV, "VLLM_CPU_KVCACHE_SPACE": "2"})
    with tempfile.TemporaryDirectory() as workdir:
        root = Path(workdir)
        spec = tiny_models.DSparkDraftSpec()
        weights = tiny_models.random_dspark_weights(spec)
        target = tiny_models.build_qwen3_target(root / "target")
        drafts = {
            "dspark": tiny_models.save_dspark_draft(root / "dspark", spec, weights, target),
            "dflash": tiny_models.save_dflash_draft(root / "dflash", spec, weights),
        }
        results = {
            method: measure(method, target, draft, args.batch_sizes, args.k)
            for method, draft in drafts.items()
        }

    print(
        f"\n{'method':<8}{'batch':>6}{'steps':>7}{'overhead us':>13}{'propose us':>12}"
        f"{'sync ops/step':>15}"
    )
    for method, by_batch in results.items():
        for batch_size, r in by_batch.items():
            print(
                f"{method:<8}{batch_size:>6}{r['steps']:>7}{r['overhead_us']:>13.0f}"
                f"{r['propose_us']:>12.0f}{r['syncs_per_step']:>15.0f}  {' '.join(r['sync_ops'])}"
            )
    print("\noverhead ratio DSpark / DFlash:")
    for batch_size in args.batch_sizes:
        ratio = (
            results["dspark"][batch_size]["overhead_us"]
            / results["dflash"][batch_size]["overhead_us"]
        )
        print(f"  batch {batch_size:>3}: {ratio:.2f}")


if __name__ == "__main__":
    main()
