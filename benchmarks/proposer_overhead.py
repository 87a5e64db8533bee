# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Cost of one draft step on the paged path, side by side: DSpark's
``DSparkPagedProposer.propose`` vs upstream's ``DFlashProposer.propose``.

    .venv/bin/python -m benchmarks.proposer_overhead [--batch-sizes 1 8 32] [--k 4] [--rounds 5]

Both engines (the tiny Qwen3 target, drafts with the same backbone weights;
oracle drafts by default, so every draft is accepted and both propose the same
blocks) are built once and stay alive together. Each round runs one ``generate``
call per engine and batch size, the engines in a rotated order, and times every
``propose()`` the runner makes in steady state (every request of the batch
decoding) in CPU time of this process: the engine runs in-process and vLLM runs
its torch ops on one thread while serving, so CPU time is the step's work
whatever share of the CPUs other jobs leave it. Per step it reports the whole
``propose()`` and what remains outside the draft network the two share
(context K/V precompute, fc combine, block forward, base logits): input
preparation, attention metadata, sampling; for DSpark that includes the
Markov chain (its heads and loop), i.e. what DSpark adds. Ratios DSpark /
DFlash are taken per round (median step of each), then reported as the median
over rounds [interquartile range] {min-max}.

It also counts, inside the steps of one extra call, the aten ops that wait for
the device on a GPU (``.item()``, ``nonzero``, boolean-mask indexing, ...; see
``dspark_fixtures/host_syncs.py``). On this CPU those include ops on vLLM's
host-side copies, so a count is an upper bound; zero means the step has none.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from benchmarks.cpu_side_by_side import build_models, fixed_prompts, spread
from dspark_fixtures.engine import TinyEngine
from dspark_fixtures.host_syncs import HostSyncRecorder

METHODS = ("dflash", "dspark")
# The draft network both proposers run; DSpark's draft logits are DFlash's
# logits under another name (Qwen3DSparkForCausalLM.compute_draft_logits).
SHARED_NETWORK = (
    "forward",
    "compute_logits",
    "compute_draft_logits",
    "precompute_and_store_context_kv",
    "combine_hidden_states",
)


class NetworkTime:
    """CPU time inside the wrapped draft-network methods (outermost calls only)."""

    def __init__(self, model) -> None:
        self.seconds = 0.0
        self._depth = 0
        for name in SHARED_NETWORK:
            if hasattr(model, name):
                self._wrap(model, name)

    def _wrap(self, owner: object, name: str) -> None:
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            self._depth += 1
            start = time.process_time()
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.process_time() - start

        setattr(owner, name, timed)


@contextlib.contextmanager
def steady_steps(
    engine: TinyEngine, network: NetworkTime, batch_size: int, count_syncs: bool = False
) -> Iterator[list[dict]]:
    """Per steady-state ``propose()``: its CPU time, the CPU time inside the shared
    network and (only with ``count_syncs``, which slows every op) its sync ops."""
    runner = engine.model_runner
    drafter = runner.drafter
    propose: Callable = drafter.propose
    steps: list[dict] = []

    def timed_propose(*args, **kwargs):
        decoding = (
            len(runner.input_batch.req_ids) == batch_size
            and kwargs.get("num_rejected_tokens_gpu") is not None
        )
        network.seconds = 0.0
        recorder = HostSyncRecorder() if count_syncs else contextlib.nullcontext()
        with recorder:
            start = time.process_time()
            result = propose(*args, **kwargs)
            total = time.process_time() - start
        if decoding:
            syncs = recorder.syncs if count_syncs else []
            steps.append({"total": total, "network": network.seconds, "syncs": syncs})
        return result

    drafter.propose = timed_propose
    try:
        yield steps
    finally:
        drafter.propose = propose


def measure(args: argparse.Namespace, root: Path) -> dict:
    models = build_models(args.drafts, root, trained_dir=root)
    prompts = fixed_prompts(max(args.batch_sizes))
    engines, networks = {}, {}
    try:
        for method in METHODS:
            config = {
                "method": method,
                "model": str(models[method]),
                "num_speculative_tokens": args.k,
            }
            engines[method] = TinyEngine(
                models["target"],
                config,
                max_num_seqs=max(args.batch_sizes),
                max_num_batched_tokens=max(256, max(args.batch_sizes) * 16),
            )
            networks[method] = NetworkTime(engines[method].model_runner.drafter.model)
        for engine in engines.values():
            for batch_size in args.batch_sizes:
                engine.generate(prompts[:batch_size], 8)  # warm-up, not measured
        # per method and batch size: the median step of each round
        total = {m: {b: [] for b in args.batch_sizes} for m in METHODS}
        outside = {m: {b: [] for b in args.batch_sizes} for m in METHODS}
        steps_seen = {m: {b: 0 for b in args.batch_sizes} for m in METHODS}
        for round_index in range(args.rounds):
            print(f"round {round_index + 1}/{args.rounds}", flush=True)
            order = METHODS[round_index % 2 :] + METHODS[: round_index % 2]
            for batch_size in args.batch_sizes:
                for method in order:
                    engine = engines[method]
                    with steady_steps(engine, networks[method], batch_size) as steps:
                        engine.generate(prompts[:batch_size], args.max_tokens)
                    total[method][batch_size].append(statistics.median(s["total"] for s in steps))
                    outside[method][batch_size].append(
                        statistics.median(s["total"] - s["network"] for s in steps)
                    )
                    steps_seen[method][batch_size] += len(steps)
        syncs = {}
        for method, engine in engines.items():
            for batch_size in args.batch_sizes:
                with steady_steps(engine, networks[method], batch_size, True) as counted:
                    engine.generate(prompts[:batch_size], 16)
                syncs[method, batch_size] = (
                    max(len(s["syncs"]) for s in counted),
                    sorted({op for s in counted for op in s["syncs"]}),
                )
    finally:
        for engine in engines.values():
            engine.close()
    results = {
        method: {
            batch_size: {
                "steps": steps_seen[method][batch_size],
                "propose_us": spread([t * 1e6 for t in total[method][batch_size]]),
                "outside_network_us": spread([t * 1e6 for t in outside[method][batch_size]]),
                "max_syncs_per_step": syncs[method, batch_size][0],
                "sync_ops": syncs[method, batch_size][1],
            }
            for batch_size in args.batch_sizes
        }
        for method in METHODS
    }
    ratios = {
        batch_size: {
            name: spread(
                [
                    a / b
                    for a, b in zip(
                        series["dspark"][batch_size], series["dflash"][batch_size], strict=True
                    )
                ]
            )
            for name, series in (("propose", total), ("outside_network", outside))
        }
        for batch_size in args.batch_sizes
    }
    return {"results": results, "ratios": ratios}


def _cell(stats: dict, digits: int = 0, unit: str = "") -> str:
    f = f"{{:.{digits}f}}"
    return (
        f"{f.format(stats['median'])}{unit} [{f.format(stats['q1'])}-{f.format(stats['q3'])}]"
        f" {{{f.format(stats['min'])}-{f.format(stats['max'])}}}"
    )


def format_report(report: dict, args: argparse.Namespace) -> str:
    lines = [
        f"{args.drafts} drafts, k = {args.k}, {args.rounds} rounds; per step, median over "
        "rounds [interquartile range] {min-max}",
        f"{'method':<7}{'batch':>6}{'steps':>7}{'propose() us':>34}{'outside network us':>34}"
        f"{'max sync ops/step':>19}",
    ]
    for method, by_batch in report["results"].items():
        for batch_size, r in by_batch.items():
            lines.append(
                f"{method:<7}{batch_size:>6}{r['steps']:>7}{_cell(r['propose_us']):>34}"
                f"{_cell(r['outside_network_us']):>34}{r['max_syncs_per_step']:>19}  "
                + " ".join(r["sync_ops"])
            )
    lines.append("DSpark / DFlash per step:")
    for batch_size, ratio in report["ratios"].items():
        lines.append(
            f"  batch {batch_size:>3}: propose() {_cell(ratio['propose'], 2, 'x')}, "
            f"outside the network {_cell(ratio['outside_network'], 2, 'x')}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=48, help="per request and call")
    parser.add_argument("--drafts", choices=("oracle", "random"), default="oracle")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        report = measure(args, Path(workdir))
    print(format_report(report, args))


if __name__ == "__main__":
    main()
