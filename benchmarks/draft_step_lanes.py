# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""What one draft step launches on each lane, counted side by side on the same pair.

    .venv/bin/python -m benchmarks.draft_step_lanes [--families qwen3 gemma4] [--k 4]
        [--batch 1] [--by-op]

The V1 lane's DSpark proposer and the V2 lane's upstream ``DSparkSpeculator`` (Model Runner V2,
hosted on the CPU by ``dspark_fixtures/cpu_mrv2.py`` in the V2 lane tests' runner subprocess,
``tests/engine/v2_lane_runner.py``: the host must be installed before vLLM and Triton are
imported) run the same random tiny pair of each family (the engine suite's ``random-target`` /
``random-draft``), the same k and batch, greedy drafts (probabilistic ones stop in the
interpreter, docs/lanes.md). One ``propose()`` in steady
state (the 3rd draft step) is counted by ``draft_step_cost.StepCounter`` as on the V1 lane:
each vLLM ``CustomOp`` call is one launch, every other launching op one, and each Triton kernel
launch one (V2 prepares its inputs with a Triton kernel; under ``TRITON_INTERPRET=1`` each
``kernel[grid](...)`` reaches ``InterpretedFunction.run`` once).

Graph vs eager: the V1 lane's split is ``draft_step_cost``'s (its FULL graphs captured as on
CUDA). Model Runner V2 captures no graph on a CPU; its split is read from upstream's capture
(vLLM 0.33.0 ``spec_decode/dflash/speculator.py``: ``capture()`` records
``_prepare_graph_forward``, which combines the staged target hidden states, publishes the
context anchor and stores the context K/V, then ``_generate_draft``, the draft forward and the
sequential Markov sampling), not measured: what those functions launch here counts as graph.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.draft_step_cost import (
    EAGER,
    GRAPH,
    Cost,
    StepCounter,
    capture,
    custom_ops_as_one_launch,
    graphs_captured,
    measure_propose,
    measure_step,
    weight_storages,
    within,
)
from dspark_fixtures.engine import TinyEngine, dspark_config

V1, V2 = "v1", "v2"
V2_GRAPHED = ("_generate_draft", "prepare_context_anchor", "_precompute_context_kv")
"""The speculator's methods upstream's FULL graph records (with ``combine_hidden_states``)."""
REPO = Path(__file__).resolve().parents[1]
V2_RUNNER = REPO / "tests" / "engine" / "v2_lane_runner.py"
"""Runs V2 engines in a process of their own (the CPU host must precede vLLM and Triton)."""


@contextlib.contextmanager
def triton_launches_counted(counter: StepCounter) -> Iterator[None]:
    """Count each launch of a ``@triton.jit`` kernel run by Triton's interpreter as one op and
    one launch, named ``triton::<kernel>``; the interpreter's own work inside is not counted."""
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(kernel, *args, grid, warmup, **kwargs):
        if not warmup:
            counter.count_kernel(f"triton::{kernel.__name__}")
        with _disable_current_modes():
            return run(kernel, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = counted
    try:
        yield
    finally:
        InterpretedFunction.run = run


@contextlib.contextmanager
def v2_graph_read(counter: StepCounter, speculator) -> Iterator[None]:
    """Count what upstream's FULL draft graph records as graph (read, not captured here)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name in V2_GRAPHED:
            monkeypatch.setattr(
                speculator, name, within(counter.in_graph, getattr(speculator, name))
            )
        model = speculator.model
        monkeypatch.setattr(
            model, "combine_hidden_states", within(counter.in_graph, model.combine_hidden_states)
        )
        yield


def measure_v2_step(engine: TinyEngine, batch: int) -> Cost:
    """The counts of the V2 speculator's ``MEASURED_STEP``-th ``propose()`` of a greedy batch of
    identical prompts. Upstream's FULL graph holds the draft's attention too, so no op is
    split out of it."""
    runner = engine.model_runner
    speculator = runner.speculator
    kv_caches = {cache.untyped_storage().data_ptr() for cache in runner.kv_caches}
    counter = StepCounter(weight_storages(speculator.model, runner.model), kv_caches, set())

    @contextlib.contextmanager
    def counting() -> Iterator[None]:
        with (
            counter,
            triton_launches_counted(counter),
            v2_graph_read(counter, speculator),
            custom_ops_as_one_launch(counter, speculator.model),
        ):
            yield

    measure_propose(engine, speculator, counting, batch, 0.0)
    return counter.cost


def cost_json(cost: Cost) -> dict[str, Any]:
    """What the V2 subprocess reports of a step: ops and launches by phase, and every op."""
    return {
        "ops": cost.ops,
        "launches": cost.launches,
        "by_op": [[phase, name, count] for (phase, name), count in sorted(cost.by_op.items())],
    }


def pair(family: str, root: Path) -> tuple[Path, Path]:
    """The engine suite's random tiny pair of ``family``: (target, draft)."""
    from dspark_fixtures.checkpoints.families import FAMILIES

    builder = FAMILIES[family]
    target = builder.build_target(root / f"{family}-target")
    return target, builder.save_draft(root / f"{family}-draft", builder.spec(), target)


Key = tuple[str, int, int, str]
"""(pair, k, batch, lane)."""


def measure(args: argparse.Namespace, root: Path) -> dict[Key, dict]:
    """V2 in the V2 lane's runner subprocess while V1 runs here, one engine at a time on each
    side."""
    cells = [
        (family, target, dspark_config(draft, k=k), k, batch)
        for family in args.families
        for target, draft in [pair(family, root)]
        for k in args.k
        for batch in args.batch
    ]
    plan = root / "plan.json"
    plan.write_text(
        json.dumps(
            [
                {
                    "target": str(target),
                    "speculative_config": config,
                    "engine_args": {"max_num_seqs": batch},
                    "runs": [],
                    "count_step": batch,
                }
                for _, target, config, _, batch in cells
            ]
        )
    )
    worker = subprocess.Popen(
        [sys.executable, str(V2_RUNNER), str(plan)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
    )
    costs = {}
    for family, target, config, k, batch in cells:
        with (
            graphs_captured([batch]),
            TinyEngine(target, config, max_num_seqs=batch) as engine,
        ):
            capture(engine)
            costs[family, k, batch, V1] = cost_json(measure_step(engine, batch, 0.0, True))
    stdout, stderr = worker.communicate()
    lines = [line for line in stdout.splitlines() if line.startswith("PROBE ")]
    if worker.returncode or not lines:
        raise RuntimeError(f"the V2 lane's engines failed:\n{stderr[-3000:]}")
    report = json.loads(lines[-1].removeprefix("PROBE "))
    for (family, _, _, k, batch), engine in zip(cells, report["engines"], strict=True):
        costs[family, k, batch, V2] = engine["step_cost"]
    return costs


def triton_launches(cost: dict) -> int:
    return sum(count for _, name, count in cost["by_op"] if name.startswith("triton::"))


def format_report(costs: dict[Key, dict]) -> str:
    lines = [
        "One steady-state draft step (propose()) per lane, same pair, k and batch. launches: the",
        "kernels a GPU runs (a vLLM custom op or a Triton kernel is one); graph + eager: inside",
        "a CUDA graph on CUDA + eagerly around it (V2: upstream's capture, read, not measured).",
        "",
        f"{'pair':<7} {'k':>2} {'B':>3} {'lane':<4} {'launches':>8} {'graph':>6} {'eager':>6}"
        f" {'triton':>6} {'ops':>5}",
    ]
    for (family, k, batch, lane), cost in sorted(costs.items()):
        launches = cost["launches"]
        lines.append(
            f"{family:<7} {k:>2} {batch:>3} {lane:<4} {sum(launches.values()):>8}"
            f" {launches[GRAPH]:>6} {launches[EAGER]:>6} {triton_launches(cost):>6}"
            f" {sum(cost['ops'].values()):>5}"
        )
    return "\n".join(lines)


def by_op_lines(costs: dict[Key, dict]) -> list[str]:
    lines = []
    for key, cost in sorted(costs.items()):
        lines.append(f"\n{' '.join(map(str, key))}")
        lines += [f"  {phase:<5} {count:>4}  {name}" for phase, name, count in cost["by_op"]]
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--families", nargs="+", choices=["qwen3", "gemma4"], default=["qwen3", "gemma4"]
    )
    parser.add_argument("--k", type=int, nargs="+", default=[4])
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--by-op", action="store_true", help="also list every op counted")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        costs = measure(args, Path(workdir))
    print(format_report(costs))
    if args.by_op:
        print("\n".join(by_op_lines(costs)))


if __name__ == "__main__":
    main()
