# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""What one draft step costs, counted instead of timed: the same numbers on every run.

    .venv/bin/python -m benchmarks.draft_step_cost [--k 4 7] [--batch 1 4 32] [--padded 3]
        [--families paged ring] [--draft-sample-method greedy probabilistic]
        [--confidence on off] [--markov-chain one-launch|per-position] [--json PATH]

Launches are counted on tiny engines, where only the number of ops matters; FLOPs, bytes and a
modelled time come from the real sizes of the shipped drafts (``draft_step_model``).

For each proposer (DSpark paged, a block-7 draft with its confidence head, scheduling off and
on, and upstream DFlash, on the tiny Qwen3 target with the same backbone weights; DSpark ring on
the tiny DeepSeek-V4 target, its shipped block of 5), k, sampling and batch, one ``propose()``
in steady state (every request of the batch decoding, the 3rd draft step) is run under a torch
dispatch mode that counts, per dispatched op:

  * ops: the ops that launch work (view ops, allocations and no-ops are left out);
  * launches: the kernels a GPU runs for them: each call of a vLLM ``CustomOp`` (RMSNorm, its
    fused residual add, SiluAndMul, rotary embedding, ...) is one launch, as vLLM's C kernel or
    the one kernel Inductor fuses its native code into (the draft is compiled on CUDA), however
    many aten ops it dispatches here; every other op is one launch;
  * FLOPs and bytes of the tiny models (torch's FLOP formulas plus vLLM's CPU GEMM; every op's
    tensor inputs and outputs), printed for reference only.

Each count is split by where the op runs on CUDA: inside a CUDA graph or eagerly around it.
Greedy and sampled chains take the fused Markov kernels as on CUDA (``markov_kernel``): each of
their Triton launches counts as one (the kernels are recorded, not run, on this CPU; the drafts
and distributions come from the same sums in torch), the one-launch chain by default, one launch
a position with ``--markov-chain per-position``. DSpark's proposers plan, capture and
replay their FULL graphs as on CUDA, each graph replaced by its own function
(``dspark_fixtures/cuda_graphs.py``): what a replay runs counts as graph, the copies into the
graphs' fixed inputs and out of their outputs as eager.
The paged draft model's forward (DFlash and DSpark) counts as graph, as upstream's piecewise
graphs replay it, except
vLLM's splitting ops (attention, ``CompilationConfig._attention_ops``). Graphs are captured for
``--batch``; a ``--padded`` batch replays the next larger one.

DSpark is compared with its baseline at equal k, batch and sampling: upstream DFlash for the
paged family; for the ring family (vLLM has no DFlash of DeepSeek-V4) its own step less the
launches of the Markov chain and the confidence head. The table gives DSpark / baseline for
launches (measured), FLOPs and bytes (modelled at real size) and the modelled step time per
device; ``--json`` writes them as ``{family: {k: {sample: {...}}}}``.

The ring family's tiny target needs torch stand-ins for the DeepSeek-V4 kernels this host's
vLLM lacks (``dspark_fixtures/standins.py``); each stand-in registers as the op it replaces, so
the dispatch mode counts it as that one op.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from benchmarks.draft_step_model import (
    DEVICES,
    GEOMETRIES,
    StepCost,
    markov_w2_bytes,
    modelled_us,
    step_cost,
)
from dspark_fixtures.checkpoints.qwen3 import (
    DSparkDraftSpec,
    build_qwen3_target,
    random_dspark_weights,
    save_dflash_draft,
    save_dspark_draft,
)
from dspark_fixtures.engine import TinyEngine

GRAPH, EAGER = "graph", "eager"
MEASURED_STEP = 3
PROMPT = list(range(5, 21))


@dataclass
class Cost:
    """Counts of one draft step, by where its ops run on CUDA."""

    ops: dict[str, int] = field(default_factory=lambda: {GRAPH: 0, EAGER: 0})
    launches: dict[str, int] = field(default_factory=lambda: {GRAPH: 0, EAGER: 0})
    """Kernels as a GPU runs them: ``ops``, with each vLLM custom op counted as one."""
    flops: dict[str, int] = field(default_factory=lambda: {GRAPH: 0, EAGER: 0})
    weight_bytes: dict[str, int] = field(default_factory=lambda: {GRAPH: 0, EAGER: 0})
    activation_bytes: dict[str, int] = field(default_factory=lambda: {GRAPH: 0, EAGER: 0})
    dspark_launches: dict[str, int] = field(default_factory=lambda: {GRAPH: 0, EAGER: 0})
    """Of ``launches``, those of the Markov chain and the confidence head."""
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
        self._fused_depth = 0
        self._dspark_depth = 0
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

    @contextlib.contextmanager
    def one_launch(self) -> Iterator[None]:
        """What runs inside is one kernel on CUDA (a vLLM custom op: its C kernel, or the one
        Inductor fuses its native code into)."""
        if not self._fused_depth:
            self._launch(self.phase)
        self._fused_depth += 1
        try:
            yield
        finally:
            self._fused_depth -= 1

    @contextlib.contextmanager
    def dspark_only(self) -> Iterator[None]:
        """What runs inside is DSpark's own (the Markov chain, the confidence head)."""
        self._dspark_depth += 1
        try:
            yield
        finally:
            self._dspark_depth -= 1

    def count_kernel(self, name: str) -> None:
        """One kernel launched outside torch's dispatcher (a Triton kernel): one op, one
        launch."""
        self.cost.ops[self.phase] += 1
        self.cost.by_op[self.phase, name] += 1
        if not self._fused_depth:
            self._launch(self.phase)

    def _launch(self, phase: str) -> None:
        self.cost.launches[phase] += 1
        if self._dspark_depth:
            self.cost.dspark_launches[phase] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.name()
        if func.is_view or name.startswith(NO_KERNEL):
            return out
        phase = EAGER if name.split(".")[0] in self._splitting_ops else self.phase
        cost = self.cost
        cost.ops[phase] += 1
        if not self._fused_depth:
            self._launch(phase)
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


@contextlib.contextmanager
def custom_ops_as_one_launch(counter: StepCounter, *modules: torch.nn.Module) -> Iterator[None]:
    """Count each call of a vLLM ``CustomOp`` module inside ``modules`` (RMSNorm, SiluAndMul,
    rotary embedding, ...) as one launch: on CUDA it is vLLM's C kernel, or its native code fused
    by Inductor into one kernel; on this CPU it may dispatch many aten ops."""
    from vllm.model_executor.custom_op import CustomOp

    hooks = []
    for module in modules:
        for op in module.modules():
            if isinstance(op, CustomOp):
                entered: list[contextlib.AbstractContextManager] = []

                def enter(*_, entered=entered):
                    entered.append(counter.one_launch())
                    entered[-1].__enter__()

                def leave(*_, entered=entered):
                    entered.pop().__exit__(None, None, None)

                hooks += [op.register_forward_pre_hook(enter), op.register_forward_hook(leave)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def dspark_parts_marked(counter: StepCounter, drafter) -> Iterator[None]:
    """Mark the launches of the Markov chain and the confidence head, for either proposer."""
    from vllm.v1.spec_decode.dspark import drafter as block_drafter
    from vllm.v1.spec_decode.dspark import paged_proposer

    def marked(function):
        def call(*args, **kwargs):
            with counter.dspark_only():
                return function(*args, **kwargs)

        return call

    heads = getattr(getattr(drafter, "_drafter", None), "heads", None) or drafter.model
    with pytest.MonkeyPatch.context() as monkeypatch:
        for module in (block_drafter, paged_proposer):
            monkeypatch.setattr(module, "markov_chain", marked(module.markov_chain))
        if hasattr(heads, "compute_confidence"):
            monkeypatch.setattr(heads, "compute_confidence", marked(heads.compute_confidence))
        yield


class _RecordedKernel:
    """A Triton kernel whose launches are counted, not run (Triton has no CPU backend here)."""

    def __init__(self, counter: StepCounter, name: str) -> None:
        self._counter = counter
        self._name = name

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._counter.count_kernel(f"triton::{self._name}")


# Programs GB10 keeps resident in the one-launch chain: its 48 multiprocessors' largest power of
# two (``markov_kernel.prepare``). The count of launches does not depend on it.
RESIDENT_PROGRAMS = 32


@contextlib.contextmanager
def fused_markov_chain(counter: StepCounter, one_launch: bool) -> Iterator[None]:
    """The Markov chain as it runs where Triton does: ``markov_kernel``'s launchers, each launch
    of their kernels counted; the drafts (and the distributions of sampled ones) they write come
    from the same sums in torch, with nothing counted (``tests/dspark/test_markov_kernel.py``
    shows the two draft the same). ``one_launch``: as on a CUDA device where
    ``markov_kernel.prepare`` turned the one-launch chain on; else one launch a position."""
    from torch.nn import functional
    from torch.utils._python_dispatch import _disable_current_modes

    from vllm.v1.sample.sampler import _SAMPLING_EPS
    from vllm.v1.spec_decode.dspark import markov, markov_kernel

    launchers = {
        name: getattr(markov_kernel, name)
        for name in ("greedy_markov_chain", "sampled_markov_chain")
    }

    def launched(name: str):
        def launch(base_logits, anchor_tokens, w1, w2, drafts, *sampling) -> None:
            with pytest.MonkeyPatch.context() as kernels:
                for kernel in ("_chain_kernel", "_step_kernel", "_last_kernel"):
                    kernels.setattr(markov_kernel, kernel, _RecordedKernel(counter, kernel))
                launchers[name](base_logits, anchor_tokens, w1, w2, drafts, *sampling)
            with _disable_current_modes():
                previous = anchor_tokens.long()
                vocab = base_logits.shape[-1]
                for position in range(base_logits.shape[1]):
                    bias = functional.linear(functional.embedding(previous, w1), w2[:vocab])
                    logits = base_logits[:, position] + bias
                    previous = logits.argmax(dim=-1)
                    if sampling:
                        temperature, _, probs = sampling
                        greedy = temperature < _SAMPLING_EPS
                        scale = torch.where(greedy, 1.0, temperature)[:, None]
                        probs[:, position] = (logits / scale).softmax(-1, dtype=torch.float32)
                        noise = torch.empty_like(probs[:, position]).exponential_()
                        drawn = (probs[:, position] / noise).argmax(dim=-1)
                        previous = torch.where(greedy, previous, drawn)
                    drafts[:, position] = previous

        return launch

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(markov, "fused_kernels_run_on", lambda tensor: True)
        for name in launchers:
            monkeypatch.setattr(markov_kernel, name, launched(name))
        if one_launch:
            semaphores = torch.zeros(markov_kernel.MAX_TILES, dtype=torch.uint32)
            chain = markov_kernel.WholeChain(semaphores, RESIDENT_PROGRAMS)
            monkeypatch.setitem(markov_kernel._whole_chains, torch.device("cpu"), chain)
        yield


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
    from dspark_fixtures.cuda_graphs import PassThroughGraph

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
    as on CUDA (``dspark_fixtures/cuda_graphs.py``), captured by ``capture``."""
    from dspark_fixtures.cuda_graphs import graphs_on_cpu
    from vllm.v1.spec_decode.dspark import paged_proposer, ring_proposer

    with pytest.MonkeyPatch.context() as monkeypatch:
        for module in (paged_proposer, ring_proposer):
            graphs_on_cpu(monkeypatch, module)
            monkeypatch.setattr(module, "draft_graph_sizes", lambda *_: sorted(set(batches)))
        yield


def capture(engine: TinyEngine) -> None:
    """The proposer's graphs, captured as in the runner's capture pass."""
    engine.model_runner.drafter.dummy_run(1, use_cudagraphs=False, is_graph_capturing=True)


def within(
    context: Callable[[], contextlib.AbstractContextManager], function: Callable
) -> Callable:
    """``function``, each call of it run inside a fresh ``context()``."""

    def call(*args, **kwargs):
        with context():
            return function(*args, **kwargs)

    return call


def measure_propose(
    engine: TinyEngine,
    proposer,
    counting: Callable[[], contextlib.AbstractContextManager],
    batch: int,
    temperature: float,
) -> None:
    """Run a batch of identical prompts, its ``MEASURED_STEP``-th ``proposer.propose()`` inside
    ``counting()``."""
    propose = proposer.propose
    measured = within(counting, propose)
    calls = []

    def counted(*args, **kwargs):
        calls.append(None)
        return (measured if len(calls) == MEASURED_STEP else propose)(*args, **kwargs)

    proposer.propose = counted
    try:
        engine.generate([PROMPT] * batch, MEASURED_STEP * 8, temperature)
    finally:
        del proposer.propose
    assert len(calls) >= MEASURED_STEP, "the run ended before the measured step"


def measure_step(
    engine: TinyEngine, batch: int, temperature: float, one_launch_chain: bool
) -> Cost:
    """The counts of the ``MEASURED_STEP``-th ``propose()`` of a batch of identical prompts."""
    runner = engine.model_runner
    drafter = runner.drafter
    kv_caches = {cache.untyped_storage().data_ptr() for cache in runner.kv_caches}
    weights = weight_storages(drafter.model, runner.model)
    counter = StepCounter(weights, kv_caches, splitting_ops())

    @contextlib.contextmanager
    def counting() -> Iterator[None]:
        with (
            counter,
            graphed(counter, drafter),
            custom_ops_as_one_launch(counter, drafter.model),
            dspark_parts_marked(counter, drafter),
            fused_markov_chain(counter, one_launch_chain),
        ):
            yield

    measure_propose(engine, drafter, counting, batch, temperature)
    return counter.cost


def paged_engines(
    root: Path, k: int, sample: str, confidence: list[str]
) -> Iterator[tuple[str, dict, Path]]:
    """DSpark paged (a block-7 draft with a confidence head, scheduling off and on) and upstream
    DFlash, k drafts each, the same backbone weights: (name, speculative config, target)."""
    spec = DSparkDraftSpec(
        block_size=PAGED_BLOCK, confidence_head=True, confidence_with_markov=True
    )
    weights = random_dspark_weights(spec)
    target = root / "qwen3-target"
    if not (target / "config.json").exists():
        build_qwen3_target(target, kind="random")
    dspark = root / "dspark"
    if not (dspark / "config.json").exists():
        save_dspark_draft(dspark, spec, weights, target)
    backbone = {n: w for n, w in weights.items() if not n.startswith("confidence_head.")}
    dflash = save_dflash_draft(root / f"dflash-{k}", replace(spec, block_size=k), backbone)
    common = {"num_speculative_tokens": k, "draft_sample_method": sample}
    if "off" in confidence:
        yield DSPARK_PAGED, {"method": "dspark", "model": str(dspark), **common}, target
    if "on" in confidence:
        yield (
            DSPARK_PAGED + CONF,
            {"method": "dspark", "model": str(dspark), **CONFIDENCE, **common},
            target,
        )
    yield DFLASH, {"method": "dflash", "model": str(dflash), **common}, target


def ring_engines(
    root: Path, k: int, sample: str, confidence: list[str]
) -> Iterator[tuple[str, dict, Path]]:
    """DSpark ring on the tiny DeepSeek-V4 target, its draft trained for the shipped block,
    confidence scheduling off and on."""
    from dspark_fixtures import standins
    from dspark_fixtures.checkpoints import deepseek_v4 as tiny_v4

    standins.install_standins()
    target = root / "v4"
    if not (target / "config.json").exists():
        config = {**tiny_v4.TINY_V4_CONFIG, "dspark_block_size": RING_BLOCK}
        tiny_v4.save_v4_target(target, tiny_v4.random_v4_checkpoint(config), config)
    common = {"method": "dspark", "num_speculative_tokens": k, "draft_sample_method": sample}
    if "off" in confidence:
        yield DSPARK_RING, common, target
    if "on" in confidence:
        yield DSPARK_RING + CONF, {**common, **CONFIDENCE}, target


RING_ENGINE_ARGS = dict(dtype="bfloat16", max_model_len=1024, block_size=None)
CONTEXT = 2048
PAGED_BLOCK = GEOMETRIES["paged"].block
RING_BLOCK = GEOMETRIES["ring"].block
DSPARK_PAGED, DSPARK_RING, DFLASH, CONF = "dspark (paged)", "dspark (ring)", "dflash", " +conf"
CONFIDENCE = {"dspark_confidence_scheduler": "threshold", "dspark_confidence_threshold": 0.3}
Key = tuple[str, str, int, int]
"""(sample method, proposer, k, batch)."""


def measure(args: argparse.Namespace, root: Path) -> dict[Key, Cost]:
    """One engine at a time (in-process engines share vLLM's global state)."""
    costs = {}
    batches = sorted({*args.batch, *args.padded})
    for sample in args.draft_sample_method:
        temperature = 1.0 if sample == "probabilistic" else 0.0
        for k in args.k:
            setups = []
            if "paged" in args.families:
                setups += [
                    (*setup, {}) for setup in paged_engines(root, k, sample, args.confidence)
                ]
            if "ring" in args.families and k <= RING_BLOCK:
                setups += [
                    (*setup, RING_ENGINE_ARGS)
                    for setup in ring_engines(root, k, sample, args.confidence)
                ]
            for name, spec_config, target, engine_args in setups:
                with (
                    graphs_captured(args.batch),
                    TinyEngine(
                        target, spec_config, max_num_seqs=max(batches), **engine_args
                    ) as engine,
                ):
                    if name.startswith("dspark"):
                        capture(engine)
                    for batch in batches:
                        costs[sample, name, k, batch] = measure_step(
                            engine, batch, temperature, args.markov_chain == "one-launch"
                        )
    return costs


def _padded(batch: int, captured: list[int]) -> int:
    return min((size for size in captured if size >= batch), default=batch)


@dataclass
class Comparison:
    """DSpark against its baseline at one k, batch, sampling and confidence setting."""

    family: str
    k: int
    batch: int
    padded_to: int
    sample: str
    confidence: bool
    launches: tuple[dict[str, int], dict[str, int]]
    """(DSpark, baseline) launches by phase."""
    model: tuple[StepCost, StepCost]

    def ratios(self) -> dict:
        (dspark, base), (dspark_model, base_model) = self.launches, self.model
        modelled = {}
        for device in DEVICES:
            ours = modelled_us(device, dspark_model, dspark[GRAPH], dspark[EAGER])
            theirs = modelled_us(device, base_model, base[GRAPH], base[EAGER])
            modelled[device.name] = round(ours / theirs, 3)
        return {
            "launch_ratio": round(sum(dspark.values()) / sum(base.values()), 3),
            "flop_ratio": round(dspark_model.flops / base_model.flops, 3),
            "byte_ratio": round(dspark_model.bytes / base_model.bytes, 3),
            "modelled_ratio": modelled,
        }


def compare(costs: dict[Key, Cost], args: argparse.Namespace) -> list[Comparison]:
    """Every DSpark cell against its baseline: DFlash's measured launches for the paged family;
    for the ring family, its own launches less those of the Markov chain and confidence head."""
    comparisons = []
    for sample, name, k, batch in sorted(costs):
        if not name.startswith("dspark"):
            continue
        family = "paged" if name.startswith(DSPARK_PAGED) else "ring"
        cost = costs[sample, name, k, batch]
        if family == "paged":
            base_launches = costs[sample, DFLASH, k, batch].launches
        else:
            base_launches = {
                phase: cost.launches[phase] - cost.dspark_launches[phase]
                for phase in (GRAPH, EAGER)
            }
        padded = _padded(batch, args.batch)
        confidence = name.endswith(CONF)
        geometry = GEOMETRIES[family]
        model = tuple(
            step_cost(
                geometry,
                k,
                padded,
                dspark,
                sample == "probabilistic",
                confidence and dspark,
                args.context,
            )
            for dspark in (True, False)
        )
        comparisons.append(
            Comparison(
                family, k, batch, padded, sample, confidence, (cost.launches, base_launches), model
            )
        )
    return comparisons


def report_json(comparisons: list[Comparison]) -> dict:
    """``{family: {k: {sample: the ratios at batch 1 (confidence off where measured), and
    "cells": those of every batch and confidence setting}}}``."""
    out: dict = {}
    for c in comparisons:
        cell = (
            out.setdefault(c.family, {})
            .setdefault(str(c.k), {})
            .setdefault(c.sample, {"cells": []})
        )
        ratios = c.ratios()
        cell["cells"].append(
            {"batch": c.batch, "padded_to": c.padded_to, "confidence": c.confidence, **ratios}
        )
        if c.batch == 1 and "launch_ratio" not in cell:
            cell.update(ratios)
    return out


def format_report(costs: dict[Key, Cost], comparisons: list[Comparison]) -> str:
    lines = [
        "Per draft step, counted on the tiny engines. ops: non-view ops dispatched; launches: the",
        "kernels a GPU runs (a vLLM custom op is one); graph + eager: inside a CUDA graph on CUDA",
        "+ eagerly around it.",
        "",
        f"{'sample':<13} {'proposer':<20} {'k':>2} {'B':>3} {'ops graph':>9} {'eager':>6}"
        f" {'launches graph':>14} {'eager':>6} {'tiny MFLOP':>10} {'tiny KiB':>9}",
    ]
    for (sample, name, k, batch), cost in sorted(costs.items()):
        lines.append(
            f"{sample:<13} {name:<20} {k:>2} {batch:>3} {cost.ops[GRAPH]:>9} {cost.ops[EAGER]:>6}"
            f" {cost.launches[GRAPH]:>14} {cost.launches[EAGER]:>6}"
            f" {cost.total('flops') / 1e6:>10.3f}"
            f" {(cost.total('weight_bytes') + cost.total('activation_bytes')) / 1024:>9.1f}"
        )
    devices = [device.name for device in DEVICES]
    lines += [
        "",
        "DSpark / baseline: launches counted above; FLOPs, bytes and the modelled time per",
        "device from the shipped drafts' shapes (batch padded as the graphs pad it)",
        f"{'family':<6} {'sample':<13} {'k':>2} {'B':>3} {'pad':>3} {'conf':>4} {'launch':>6}"
        f" {'FLOPs':>6} {'bytes':>6} " + " ".join(f"{name:>12}" for name in devices),
    ]
    for c in comparisons:
        r = c.ratios()
        lines.append(
            f"{c.family:<6} {c.sample:<13} {c.k:>2} {c.batch:>3} {c.padded_to:>3}"
            f" {'on' if c.confidence else 'off':>4} {r['launch_ratio']:>6.2f}"
            f" {r['flop_ratio']:>6.2f} {r['byte_ratio']:>6.2f} "
            + " ".join(f"{r['modelled_ratio'][name]:>12.2f}" for name in devices)
        )
    lines += ["", *w2_lines(comparisons)]
    return "\n".join(lines)


PRUNED_TOPK = 64


def w2_lines(comparisons: list[Comparison]) -> list[str]:
    """What reading the Markov head's ``W2`` once per position costs at batch 1 (greedy,
    confidence off) on GB10, and what candidate pruning would leave of it."""
    gb10 = DEVICES[0]
    lines = [
        f"W2 at batch 1 on {gb10.name} (greedy, confidence off; pruned: dspark_draft_topk"
        f" {PRUNED_TOPK}, same launches):",
    ]
    for c in comparisons:
        if c.batch != 1 or c.confidence or c.sample != "greedy":
            continue
        geometry = GEOMETRIES[c.family]
        dspark, base = c.launches
        base_us = modelled_us(gb10, c.model[1], base[GRAPH], base[EAGER])
        ours_us = modelled_us(gb10, c.model[0], dspark[GRAPH], dspark[EAGER])
        pruned = step_cost(geometry, c.k, 1, True, False, False, CONTEXT, topk=PRUNED_TOPK)
        pruned_us = modelled_us(gb10, pruned, dspark[GRAPH], dspark[EAGER])
        w2 = markov_w2_bytes(geometry, c.k)
        lines.append(
            f"  {c.family} k={c.k}: W2 {w2 / 1e6:.0f} MB ({w2 / gb10.bandwidth * 1e3:.2f} ms,"
            f" {w2 / c.model[1].bytes:.1%} of the baseline's bytes); modelled"
            f" {ours_us / 1e3:.2f} ms vs {base_us / 1e3:.2f} ms ({ours_us / base_us:.2f}x),"
            f" pruned {pruned_us / 1e3:.2f} ms ({pruned_us / base_us:.2f}x)"
        )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, nargs="+", default=[4, 7])
    parser.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=[1, 4, 32],
        help="batches whose graphs are captured (32: the Qwen3 Blackwell profile's max_num_seqs)",
    )
    parser.add_argument(
        "--padded", type=int, nargs="*", default=[3], help="batches that pad to a larger graph"
    )
    parser.add_argument(
        "--families", nargs="+", choices=["paged", "ring"], default=["paged", "ring"]
    )
    parser.add_argument(
        "--draft-sample-method",
        nargs="+",
        choices=["greedy", "probabilistic"],
        default=["greedy", "probabilistic"],
        help="probabilistic: drafts drawn by vLLM's draft sampler, requests at temperature 1",
    )
    parser.add_argument(
        "--confidence",
        nargs="+",
        choices=["on", "off"],
        default=["on", "off"],
        help="DSpark with confidence scheduling (threshold) on, off or both",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=CONTEXT,
        help="context tokens per request (what attention reads)",
    )
    parser.add_argument(
        "--markov-chain",
        choices=["one-launch", "per-position"],
        default="one-launch",
        help="how the fused chain's positions meet: one cooperative launch (CUDA, once "
        "markov_kernel.prepare's check passed) or one launch a position (where it did not)",
    )
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help="also write the ratios to PATH as JSON"
    )
    parser.add_argument(
        "--by-op", action="store_true", help="also list every op counted, by proposer"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        costs = measure(args, Path(workdir))
    comparisons = compare(costs, args)
    print(format_report(costs, comparisons))
    if args.json:
        args.json.write_text(json.dumps(report_json(comparisons), indent=2) + "\n")
    if args.by_op:
        for key, cost in sorted(costs.items()):
            print(f"\n{' '.join(map(str, key))}")
            for (phase, name), count in sorted(cost.by_op.items()):
                print(f"  {phase:<5} {count:>4}  {name}")


if __name__ == "__main__":
    main()
