# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""What one draft step costs, counted instead of timed: the same numbers on every run.

    .venv/bin/python -m benchmarks.draft_step_cost [--k 4 7] [--batch 1 4] [--families paged ring]
        [--draft-sample-method probabilistic]

For each proposer (DSpark paged and upstream DFlash on the tiny Qwen3 target, both drafts with
the same backbone weights; DSpark ring on the tiny DeepSeek-V4 target), k and batch, one
``propose()`` in steady state (every request of the batch decoding, the 3rd draft step) is run
under a torch dispatch mode that counts, per dispatched op:

  * ops: the ops that launch work (view ops, allocations and no-ops are left out): what eager
    mode launches on a GPU, one kernel per op, give or take a fused or split one;
  * FLOPs: torch's FLOP formulas (``torch.utils.flop_counter``) for its matmul and attention
    ops, plus 2 M K N for vLLM's CPU GEMM (``_C.onednn_mm``); vLLM's own attention ops are
    not counted (their cost is the same for both paged proposers at equal k and batch);
  * bytes: every op's tensor inputs and outputs, split into weights (the draft's and the
    target's parameters, and each GEMM's weight read) and activations, what the ops would move
    if nothing were fused (an upper bound of memory traffic); gathers and scatters count the
    rows they touch, in-place ops their tensor once, and the paged KV cache is left out.

Each count is split by where the op runs on CUDA: inside a CUDA graph or eagerly around it.
DSpark's proposers plan, capture and replay their FULL graphs as on CUDA, each graph replaced
by its own function (``tests/cuda_graphs.py``): what a replay runs counts as graph, the copies
into the graphs' fixed inputs and out of their outputs as eager. The paged draft model's
forward (DFlash and DSpark) counts as graph, as upstream's piecewise graphs replay it, except
vLLM's splitting ops (attention, ``CompilationConfig._attention_ops``). DSpark / DFlash ratios
are printed for the paged family at equal k and batch.

The ring family's tiny target needs torch stand-ins for the DeepSeek-V4 kernels this host's
vLLM lacks (``tests/engine_v4/standins.py``); each stand-in registers as the op it replaces, so
the dispatch mode counts it as that one op.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from dspark_demo.checkpoints.qwen3 import (
    DSparkDraftSpec,
    build_qwen3_target,
    random_dspark_weights,
    save_dflash_draft,
    save_dspark_draft,
)
from dspark_demo.engine import TinyEngine

GRAPH, EAGER = "graph", "eager"
MEASURED_STEP = 3
PROMPT = list(range(5, 21))


@dataclass
class Cost:
    """Counts of one draft step, by where its ops run on CUDA."""

    ops: dict[str, int] = field(default_factory=lambda: {GRAPH: 0, EAGER: 0})
    flops: dict[str, int] = field(default_factory=lambda: {GRAPH: 0, EAGER: 0})
    weight_bytes: dict[str, int] = field(default_factory=lambda: {GRAPH: 0, EAGER: 0})
    activation_bytes: dict[str, int] = field(default_factory=lambda: {GRAPH: 0, EAGER: 0})
    by_op: collections.Counter = field(default_factory=collections.Counter)

    def total(self, name: str) -> int:
        return sum(getattr(self, name).values())


# Allocations and no-ops: they launch nothing.
NO_KERNEL = ("aten::empty", "aten::lift_fresh", "aten::detach", "aten::_local_scalar_dense")
# Ops that read (gathers) or write (scatters) only the indexed rows of their first tensor.
GATHERS = ("aten::embedding", "aten::index_select", "aten::index.Tensor", "aten::gather")
SCATTERS = ("aten::index_copy", "aten::index_put", "aten::scatter")
ROW_ACCESS = GATHERS + SCATTERS


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _gemm_flops(x: torch.Tensor, out: torch.Tensor) -> int:
    return 2 * x.numel() * out.shape[-1]


class StepCounter(TorchDispatchMode):
    """Counts ops, FLOPs and bytes of every dispatched op into ``cost``; ``phase`` says where
    the op runs on CUDA (set by ``in_graph``)."""

    def __init__(self, weights: set[int], kv_caches: set[int], splitting_ops: set[str]) -> None:
        super().__init__()
        self.cost = Cost()
        self.phase = EAGER
        self._weights = weights
        self._kv_caches = kv_caches
        self._splitting_ops = splitting_ops

    @contextlib.contextmanager
    def in_graph(self) -> Iterator[None]:
        """Ops dispatched inside run in a CUDA graph on CUDA."""
        outer, self.phase = self.phase, GRAPH
        try:
            yield
        finally:
            self.phase = outer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.name()
        if func.is_view or name.startswith(NO_KERNEL):
            return out
        phase = EAGER if name.split(".")[0] in self._splitting_ops else self.phase
        cost = self.cost
        cost.ops[phase] += 1
        cost.by_op[phase, name] += 1
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        cost.flops[phase] += self._flops(func, args, kwargs, out, inputs, outputs)
        if name.startswith(ROW_ACCESS):
            # The first tensor is touched only where indexed: the rows read (gathers) or
            # written (scatters).
            table, *inputs = inputs
            rows = outputs[0] if name.startswith(GATHERS) else inputs[-1]
            self._add_bytes(phase, table, rows.numel() * table.element_size())
        read = {tensor.untyped_storage().data_ptr() for tensor in inputs}
        if name.startswith(ROW_ACCESS):
            read.add(table.untyped_storage().data_ptr())
        # An in-place op's output is its input: counted once.
        written = [t for t in outputs if t.untyped_storage().data_ptr() not in read]
        for tensor in inputs + written:
            self._add_bytes(phase, tensor, _nbytes(tensor))
        if name == "_C::onednn_mm":
            # vLLM's CPU GEMM reads its weight through a handle: K x N of the input's dtype.
            output, x = args[0], args[1]
            cost.weight_bytes[phase] += x.shape[-1] * output.shape[-1] * x.element_size()
        return out

    def _add_bytes(self, phase: str, tensor: torch.Tensor, nbytes: int) -> None:
        storage = tensor.untyped_storage().data_ptr()
        if storage in self._kv_caches:
            return
        if storage in self._weights:
            self.cost.weight_bytes[phase] += nbytes
        else:
            self.cost.activation_bytes[phase] += nbytes

    @staticmethod
    def _flops(func, args, kwargs, out, inputs, outputs) -> int:
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            return int(formula(*args, **kwargs, out_val=out))
        if func.name() == "_C::onednn_mm":
            return _gemm_flops(args[1], args[0])
        if func.name() == "aten::linear":
            return _gemm_flops(args[0], outputs[0])
        return 0


def splitting_ops() -> set[str]:
    """vLLM's piecewise-graph splitting ops, as ``namespace::name``."""
    from vllm.config.compilation import CompilationConfig

    return set(CompilationConfig._attention_ops)


def weight_storages(*modules: torch.nn.Module) -> set[int]:
    return {
        tensor.untyped_storage().data_ptr()
        for module in modules
        for tensor in (*module.parameters(), *module.buffers())
    }


@contextlib.contextmanager
def graphed(counter: StepCounter, drafter) -> Iterator[None]:
    """Mark what runs in CUDA graphs on CUDA: the replays of the draft's FULL graphs (run by
    ``PassThroughGraph``) and the paged draft forward (upstream's piecewise graphs)."""
    from tests.cuda_graphs import PassThroughGraph

    replay = PassThroughGraph.__call__

    def replay_in_graph(graph, size):
        with counter.in_graph():
            return replay(graph, size)

    PassThroughGraph.__call__ = replay_in_graph
    model = drafter.model
    hooks = []
    if hasattr(drafter, "_draft_attn_layer_names"):  # the paged proposers' piecewise forward
        hooks = [
            model.register_forward_pre_hook(lambda *_: setattr(counter, "phase", GRAPH)),
            model.register_forward_hook(lambda *_: setattr(counter, "phase", EAGER)),
        ]
    try:
        yield
    finally:
        PassThroughGraph.__call__ = replay
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def graphs_captured(batches: list[int]) -> Iterator[None]:
    """While an engine starts and runs: DSpark plans its FULL graphs for ``batches`` requests
    as on CUDA (``tests/cuda_graphs.py``), captured by ``capture``."""
    from tests.cuda_graphs import graphs_on_cpu
    from vllm.v1.spec_decode.dspark import paged_proposer, ring_proposer

    with pytest.MonkeyPatch.context() as monkeypatch:
        for module in (paged_proposer, ring_proposer):
            graphs_on_cpu(monkeypatch, module)
            monkeypatch.setattr(module, "draft_graph_sizes", lambda *_: sorted(set(batches)))
        yield


def capture(engine: TinyEngine) -> None:
    """The proposer's graphs, captured as in the runner's capture pass."""
    engine.model_runner.drafter.dummy_run(1, use_cudagraphs=False, is_graph_capturing=True)


def measure_step(engine: TinyEngine, batch: int, temperature: float) -> Cost:
    """The counts of the ``MEASURED_STEP``-th ``propose()`` of a batch of identical prompts."""
    runner = engine.model_runner
    drafter = runner.drafter
    kv_caches = {cache.untyped_storage().data_ptr() for cache in runner.kv_caches}
    weights = weight_storages(drafter.model, runner.model)
    counter = StepCounter(weights, kv_caches, splitting_ops())
    propose = drafter.propose
    calls = []

    def counted(*args, **kwargs):
        calls.append(None)
        if len(calls) != MEASURED_STEP:
            return propose(*args, **kwargs)
        with counter, graphed(counter, drafter):
            return propose(*args, **kwargs)

    drafter.propose = counted
    try:
        engine.generate([PROMPT] * batch, MEASURED_STEP * 8, temperature)
    finally:
        del drafter.propose
    assert len(calls) >= MEASURED_STEP, "the run ended before the measured step"
    return counter.cost


def paged_engines(root: Path, k: int) -> Iterator[tuple[str, dict, Path]]:
    """DSpark paged and upstream DFlash, k drafts each, the same backbone weights: (name,
    speculative config, target)."""
    spec = DSparkDraftSpec(block_size=k)
    weights = random_dspark_weights(spec)
    target = root / "qwen3-target"
    if not (target / "config.json").exists():
        build_qwen3_target(target, kind="random")
    drafts = {
        "dspark (paged)": save_dspark_draft(root / f"dspark-{k}", spec, weights, target),
        "dflash": save_dflash_draft(root / f"dflash-{k}", spec, weights),
    }
    for name, draft in drafts.items():
        method = name.split()[0]
        yield name, {"method": method, "model": str(draft), "num_speculative_tokens": k}, target


def ring_engine(root: Path, k: int) -> Iterator[tuple[str, dict, Path]]:
    """DSpark ring on the tiny DeepSeek-V4 target (its draft trained for block k)."""
    from dspark_demo.checkpoints import deepseek_v4 as tiny_v4
    from tests.engine_v4 import standins

    standins.install_standins()
    config = {**tiny_v4.TINY_V4_CONFIG, "dspark_block_size": k}
    target = tiny_v4.save_v4_target(root / f"v4-{k}", tiny_v4.random_v4_checkpoint(config), config)
    yield "dspark (ring)", {"method": "dspark", "num_speculative_tokens": k}, target


RING_ENGINE_ARGS = dict(dtype="bfloat16", max_model_len=1024, block_size=None)


def measure(args: argparse.Namespace, root: Path) -> dict[tuple[str, int, int], Cost]:
    """One engine at a time (in-process engines share vLLM's global state)."""
    costs = {}
    for k in args.k:
        setups = []
        if "paged" in args.families:
            setups += [(*setup, {}) for setup in paged_engines(root, k)]
        if "ring" in args.families:
            setups += [(*setup, RING_ENGINE_ARGS) for setup in ring_engine(root, k)]
        for name, spec_config, target, engine_args in setups:
            spec_config["draft_sample_method"] = args.draft_sample_method
            with (
                graphs_captured(args.batch),
                TinyEngine(target, spec_config, **engine_args) as engine,
            ):
                if name.startswith("dspark"):
                    capture(engine)
                for batch in args.batch:
                    costs[name, k, batch] = measure_step(engine, batch, args.temperature)
    return costs


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}" if b else "-"


def format_report(costs: dict[tuple[str, int, int], Cost]) -> str:
    lines = [
        "Per draft step. ops: non-view ops dispatched (one GPU launch each in eager mode);",
        "graph + eager: inside a CUDA graph on CUDA + eagerly around it. FLOPs and bytes: totals.",
        "",
        f"{'proposer':<15} {'k':>2} {'B':>2} {'ops graph':>9} {'eager':>6} {'MFLOP':>9}"
        f" {'weights KiB':>11} {'activ. KiB':>10}",
    ]
    for (method, k, batch), cost in sorted(costs.items(), key=lambda item: item[0][1:]):
        lines.append(
            f"{method:<15} {k:>2} {batch:>2} {cost.ops[GRAPH]:>9} {cost.ops[EAGER]:>6}"
            f" {cost.total('flops') / 1e6:>9.3f} {cost.total('weight_bytes') / 1024:>11.1f}"
            f" {cost.total('activation_bytes') / 1024:>10.1f}"
        )
    pairs = sorted(
        {(k, batch) for (method, k, batch) in costs if method in ("dspark (paged)", "dflash")}
    )
    if pairs:
        lines += [
            "",
            "DSpark paged / DFlash",
            f"{'k':>2} {'B':>2} {'ops':>5} {'graph':>6} {'eager':>6} {'FLOPs':>6}"
            f" {'weights':>8} {'activ.':>7}",
        ]
    for k, batch in pairs:
        dspark, dflash = costs["dspark (paged)", k, batch], costs["dflash", k, batch]
        lines.append(
            f"{k:>2} {batch:>2} {_ratio(dspark.total('ops'), dflash.total('ops')):>5}"
            f" {_ratio(dspark.ops[GRAPH], dflash.ops[GRAPH]):>6}"
            f" {_ratio(dspark.ops[EAGER], dflash.ops[EAGER]):>6}"
            f" {_ratio(dspark.total('flops'), dflash.total('flops')):>6}"
            f" {_ratio(dspark.total('weight_bytes'), dflash.total('weight_bytes')):>8}"
            f" {_ratio(dspark.total('activation_bytes'), dflash.total('activation_bytes')):>7}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, nargs="+", default=[4, 7])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument(
        "--families", nargs="+", choices=["paged", "ring"], default=["paged", "ring"]
    )
    parser.add_argument(
        "--draft-sample-method",
        choices=["greedy", "probabilistic"],
        default="greedy",
        help="probabilistic: drafts drawn by vLLM's draft sampler, requests at --temperature",
    )
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument(
        "--by-op", action="store_true", help="also list every op counted, by proposer"
    )
    args = parser.parse_args(argv)
    if args.temperature is None:
        args.temperature = 1.0 if args.draft_sample_method == "probabilistic" else 0.0
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(
        f"draft_sample_method={args.draft_sample_method}, temperature={args.temperature}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as workdir:
        costs = measure(args, Path(workdir))
    print(format_report(costs))
    if args.by_op:
        for (method, k, batch), cost in sorted(costs.items()):
            print(f"\n{method} k={k} B={batch}")
            for (phase, name), count in sorted(cost.by_op.items()):
                print(f"  {phase:<5} {count:>4}  {name}")


if __name__ == "__main__":
    main()
