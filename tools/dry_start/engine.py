# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""One rank's start-up through vLLM's own code, as far as it goes without loading weights.

Run with the Python of the vLLM that serves, from the project root: `python3 -m
tools.dry_start.engine [--rank N] [--env NAME=VALUE] [--json] -- SERVE_ARGS` (the launcher runs
it so in the image on each node; `python -m tools.dry_start` on a host without the device).
It parses the arguments with vLLM's `vllm serve` parser and builds the `VllmConfig`, then starts
vLLM's `EngineCore` with a worker and an executor that subclass vLLM's own (`Worker`,
`UniProcExecutor`) for this rank: the model runner, the DSpark proposer, the target and the draft
built with vLLM's classes, the KV-cache specs, layout and sizing, the attention backends, the
CUDA-graph plan and the scheduler are vLLM's. It prints every decision and stops at the first
refusal with vLLM's message.

Replaced, because a dry start loads no weights, runs no kernel and starts one rank alone (the
device and the other ranks inside `dry_device`, which restores what it replaced):
- the weights: the model is built on the meta device (the `dspark_dry` model loader, and every
  tensor model code puts on the CUDA device goes to the meta device); no checkpoint tensor is
  read, no post-load weight processing (repacking for kernels) runs for the target; the loader is
  a `DummyModelLoader`, so DSpark's drafts read no checkpoint (the overlay's `reads_checkpoint`);
- the other ranks: PyTorch's fake process group stands in for them (collectives do nothing),
  the device communicator is vLLM's base class (no NCCL), the tensor-parallel group has no
  shared-memory broadcaster, and which ranks share a node is answered from the deployment's
  `--nnodes` (vLLM's probe would read another rank's broadcast, which a fake group never fills);
- on a table device, free memory: each of the table's figures in turn (an integrated device's
  range at boot), measured by vLLM's `MemorySnapshot` and checked by its `request_memory`;
- the device's memory use: the profile run and the graph capture run kernels, so the KV budget
  is what the requested memory (`gpu_memory_utilization` x the device's memory, vLLM's
  `request_memory`) leaves after the weights and every buffer, an upper bound because the
  activation peak and the graphs' memory are not measured; no caching-allocator tuning, no
  CUDA-graph memory pool;
- vLLM inspects model classes in this process instead of a subprocess.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import gc
import io
import json
import logging
import os
import re
import shlex
import sys
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from dspark_common.operator_input import escaped
from dspark_common.vllm_flags import closest_flags

DRY_LOAD_FORMAT = "dspark_dry"
GIB = 1 << 30
MAX_MESSAGE = 2000
"""Longest refusal message shown (vLLM's messages quote the arguments)."""
# Steps whose refusal is of the arguments themselves (the rank, vLLM's parser and its config
# validators): exit status 2, as for any bad argument; a refusal while the engine starts is 1.
ARGUMENT_STEPS = ("arguments", "config")
# Where a refusal's message points: the vLLM setting it names (in snake case, as its flag, or in
# words: "tensor parallel size") -> the profile field that sets it.
PROFILE_FIELDS = {
    "kv_cache_dtype": "kv_cache_dtype",
    "kv-cache-dtype": "kv_cache_dtype",
    "moe_backend": "serve_args --moe-backend",
    "moe-backend": "serve_args --moe-backend",
    "max_cudagraph_capture_size": "serve_args --max-cudagraph-capture-size",
    "cudagraph_capture_sizes": "serve_args --compilation-config cudagraph_capture_sizes",
    "num_speculative_tokens": "speculative.num_speculative_tokens",
    "max_num_seqs": "max_num_seqs",
    "max_model_len": "max_model_len",
    "block_size": "serve_args --block-size",
    "block-size": "serve_args --block-size",
    "gpu_memory_utilization": "serve_args --gpu-memory-utilization",
    "utilization": "serve_args --gpu-memory-utilization",  # vLLM's "GPU memory utilization"
    "tensor_parallel_size": "tensor_parallel_size",
    "quantization": "serve_args --quantization",
    "attention_backend": "serve_args --attention-backend",
    "attention-backend": "serve_args --attention-backend",
    "dtype": "dtype",
}


@dataclass
class Decision:
    """One choice vLLM made."""

    step: str
    name: str
    value: str


@dataclass
class Refusal:
    """Where vLLM stopped, with its own message."""

    step: str
    message: str
    cause: str
    fix: str


@dataclass
class Report:
    rank: int
    decisions: list[Decision] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    refusal: Refusal | None = None
    not_run: str | None = None  # what this host cannot start, and where it runs instead

    @property
    def ok(self) -> bool:
        return self.refusal is None

    def decide(self, step: str, name: str, value: object) -> None:
        self.decisions.append(Decision(step, name, str(value)))

    def as_json(self) -> dict:
        return {**asdict(self), "ok": self.ok}

    def lines(self) -> Iterator[str]:
        for decision in self.decisions:
            yield f"{decision.step:>8}  {decision.name}: {decision.value}"
        for warning in self.warnings:
            yield f" warning  {warning}"
        if self.not_run:
            yield f" not run  {self.not_run}"
        if self.refusal:
            refusal = self.refusal
            yield (
                f"REFUSED at {refusal.step}: {refusal.message} (profile: {refusal.cause}; "
                f"fix: {refusal.fix})"
            )
        elif self.not_run:
            yield f"stopped: rank {self.rank} passed every step above; what did not run is above"
        else:
            yield f"ok: rank {self.rank} starts as far as it goes without a device"


class Refused(Exception):
    """vLLM refused the deployment during `step`."""

    def __init__(self, step: str, error: BaseException) -> None:
        super().__init__(step)
        self.step = step
        self.error = error


class Exited(Exception):
    """vLLM exited (`SystemExit`) instead of returning: its parser on `--help` or on an argument
    it cannot parse, or start-up code that calls `sys.exit`."""

    cause = "serve_args"

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


class RankOutsideWorld(ValueError):
    """The rank to play is not one of the deployment's ranks."""

    cause = "--rank"
    fix = "pass a rank from 0 to the world size - 1 (tensor_parallel_size x pipeline parallel)"


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    try:
        yield
    except Refused:
        raise
    except Exception as error:  # vLLM refuses with ValueError, AssertionError, pydantic, ...
        raise Refused(name, error) from error
    except SystemExit as error:  # a verdict too: the dry start never ends without one
        exited = Exited(
            f"vLLM exited with status {error.code} during {name}",
            "run the same arguments with `vllm serve` to see why it exits",
        )
        raise Refused(name, exited) from error


class WarningLog(logging.Handler):
    """vLLM's warnings while it starts: among them, what it rewrote (a truncated capture size)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage().strip()
        if message and message not in self.messages:
            self.messages.append(message)


def named_settings(message: str) -> set[str]:
    """The settings a message may name: its words and flags (`--moe-backend`, `block_size`),
    and runs of two to four words joined by `_` ("tensor parallel size")."""
    words = [word.strip("-") for word in re.findall(r"[\w-]+", message.lower())]
    runs = {
        "_".join(words[start : start + length])
        for length in range(2, 5)
        for start in range(len(words) - length + 1)
    }
    return set(words) | runs


def refusal(error: Refused) -> Refusal:
    """vLLM's own message, on one line, and the profile field it names."""
    message = str(error.error).strip() or type(error.error).__name__
    if hasattr(error.error, "errors"):  # pydantic: the validator's own message
        message = "; ".join(str(e.get("msg", e)) for e in error.error.errors())
    lines = [line for line in message.splitlines() if line.strip()]
    message = escaped(" ".join(line.strip() for line in lines), MAX_MESSAGE)
    named = named_settings(message)
    causes = list(dict.fromkeys(field for key, field in PROFILE_FIELDS.items() if key in named))
    cause = getattr(error.error, "cause", None) or " or ".join(causes) or "serve_args"
    fix = getattr(error.error, "fix", None) or (
        f"change {cause} to a value vLLM accepts here (its message above says which)"
    )
    return Refusal(error.step, message, cause, fix)


# vLLM's start-up, played for one rank -----------------------------------------------------


def parse_serve_args(serve_args: list[str]) -> argparse.Namespace:
    """`vllm serve`'s parser and checks, as the CLI runs them before starting anything. The
    parser exits on `--help` and on what it cannot parse: `Exited`, with its last line."""
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            args = parser.parse_args(serve_args)
    except SystemExit as error:
        lines = [line.strip() for line in printed.getvalue().splitlines() if line.strip()]
        if error.code:
            said = lines[-1] if lines else "no message"
            raise Exited(
                f"vLLM's serve parser exited with status {error.code}: {said}"
                f"{closest_flags(parser, said)}",
                "change serve_args to flags `vllm serve` accepts",
            ) from None
        raise Exited(
            "vLLM's serve parser printed its help and exited (status 0) instead of returning "
            "the arguments: serve_args holds a flag that prints and exits (--help)",
            "remove --help from serve_args",
        ) from None
    finally:
        sys.stderr.write(printed.getvalue())  # with vLLM's log, on stderr
    if args.model_tag is not None:  # ServeSubcommand.cmd: the positional model wins
        args.model = args.model_tag
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    return args


def create_config(args: argparse.Namespace):
    """`VllmConfig` as `vllm serve` creates it (every config validator runs here)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    engine_args = AsyncEngineArgs.from_cli_args(args)
    return engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER, headless=args.headless)


@dataclass
class FreeMemoryCases:
    """Free memory figures to start at where the device is a table's: (label, bytes), the first
    deciding whether the rank starts, and how to make the device report one."""

    cases: list[tuple[str, int]]
    report: Callable[[int], None]


@dataclass
class MemoryCase:
    """vLLM's `request_memory` at one free memory figure: what it requests, or its refusal."""

    label: str
    free: int
    requested: int | None
    refusal: str | None


def memory_case(label: str, snapshot, cache_config) -> MemoryCase:
    from vllm.v1.worker.utils import request_memory

    try:
        requested = request_memory(snapshot, cache_config)
    except ValueError as error:
        return MemoryCase(label, snapshot.free_memory, None, str(error))
    return MemoryCase(label, snapshot.free_memory, requested, None)


def vllm_classes(rank: int, free_cases: FreeMemoryCases | None, layout: list) -> dict[str, type]:
    """vLLM's loader, worker and executor, each with only the device part replaced.

    Defined after vLLM is imported (the caller sets the rank's environment first) and published
    on this module, because vLLM resolves the worker class by its qualified name.
    `free_cases` are the free memory figures to measure where the device is a table's; the
    worker puts its parallel config in `layout` (`dry_device`'s same-node answer reads it).
    """
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from typing_extensions import override

    from vllm.model_executor.model_loader import DummyModelLoader, register_model_loader
    from vllm.platforms import current_platform
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.executor.uniproc_executor import UniProcExecutor
    from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
    from vllm.v1.worker.utils import request_memory
    from vllm.v1.worker.worker_base import CompilationTimes

    @register_model_loader(DRY_LOAD_FORMAT)
    class DryModelLoader(DummyModelLoader):
        """Builds the model with vLLM's classes on the meta device; reads no weights and writes
        none. A `DummyModelLoader`, so DSpark's drafts read no checkpoint either (the overlay's
        `reads_checkpoint`)."""

        @override
        def load_weights(self, model, model_config) -> None:
            pass

        @override
        def load_model(self, vllm_config, model_config, prefix=""):
            with set_default_torch_dtype(model_config.dtype), torch.device("meta"):
                model = self.create_model(vllm_config, model_config, prefix=prefix)
            return model.eval()

    class DryWorker(Worker):
        """vLLM's GPU worker for one rank of the deployment, on the meta device."""

        @override
        def init_device(self) -> None:
            self.device = torch.device("meta")
            world_size = self.parallel_config.world_size_across_dp
            dist.init_process_group(
                "fake", store=FakeStore(), rank=self.rank, world_size=world_size
            )
            layout.append(self.parallel_config)
            init_worker_distributed_environment(
                self.vllm_config, self.rank, "env://", self.local_rank, "fake"
            )
            # The node's device as vLLM measures it, or each of the table's figures in turn;
            # vLLM's own functions measure (on an integrated GPU, the host's available memory)
            # and decide. The first decides whether the rank starts.
            device = torch.device(current_platform.device_type, 0)
            snapshots = []
            for label, free in free_cases.cases if free_cases else [("measured", 0)]:
                if free_cases is not None:
                    free_cases.report(free)
                snapshots.append((label, MemorySnapshot(device=device)))
            self.memory_cases = [memory_case(label, s, self.cache_config) for label, s in snapshots]
            self.init_snapshot = snapshots[0][1]
            self.requested_memory = request_memory(self.init_snapshot, self.cache_config)
            self._init_workspace_and_model_runner()

        @override
        def _scoped_allocator_max_split(self, max_split_size_mb: int):
            """The meta device has no caching allocator to tune."""
            return contextlib.nullcontext()

        @override
        def determine_available_memory(self) -> int:
            """What the requested memory leaves after the weights and the buffers (the profile
            run, which would measure the activation peak, runs kernels)."""
            held = sum(_meta_storages().values())
            self.dry_memory = {"requested": self.requested_memory, "held": held}
            return self.requested_memory - held

        @override
        def compile_or_warm_up_model(self) -> CompilationTimes:
            """Warm-up and capture run kernels: the plan is read from the runner instead."""
            return CompilationTimes(language_model=0.0, encoder=0.0)

    class DryExecutor(UniProcExecutor):
        """vLLM's in-process executor, for this rank of the deployment."""

        @override
        def _distributed_args(self) -> tuple[str, int, int]:
            return "env://", rank, 0

    module = sys.modules[__name__]
    classes = {"DryWorker": DryWorker, "DryExecutor": DryExecutor}
    for name, cls in classes.items():
        cls.__module__, cls.__qualname__ = __name__, name
        setattr(module, name, cls)
    return classes


def meta_device():
    """A torch function mode in which every tensor meant for the CUDA device is made on the meta
    device: model code that names the device (`current_platform.device_type`) allocates nothing
    there either."""
    import torch
    from torch.overrides import TorchFunctionMode

    def to_meta(value):
        if isinstance(value, torch.device) and value.type == "cuda":
            return torch.device("meta")
        if isinstance(value, str) and (value == "cuda" or value.startswith("cuda:")):
            return "meta"
        return value

    class MetaDevice(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            args = tuple(to_meta(arg) for arg in args)
            kwargs = {key: to_meta(value) for key, value in (kwargs or {}).items()}
            if func is torch.Tensor.cuda:
                return args[0].to("meta")
            return func(*args, **kwargs)

    return MetaDevice()


def _meta_storages() -> dict[int, int]:
    """Every storage this process holds on the meta device (what the device would hold), each
    counted once however many tensors view it: storage id -> bytes."""
    import torch

    storages = {}
    with warnings.catch_warnings():  # isinstance() on deprecated torch aliases warns
        warnings.simplefilter("ignore", FutureWarning)
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.is_meta:
                storage = obj.untyped_storage()
                storages[storage._cdata] = storage.nbytes()
    return storages


def dry_platform(base: type | None = None) -> type:
    """vLLM's CUDA platform (`base`, else the one vLLM detects) with the device communicator
    of a single rank: the other ranks do not run, so there is nothing to reach over NCCL."""
    from typing_extensions import override

    import vllm.platforms

    base = base or type(vllm.platforms.current_platform)

    class DryStartPlatform(base):  # type: ignore[valid-type,misc]  # a base chosen at run time
        @classmethod
        @override
        def get_current_memory_usage(cls, device=None) -> float:
            """The model is built on the meta device: nothing of it is on the device."""
            return 0.0

        @override
        def get_global_graph_pool(self) -> object:
            """A CUDA-graph memory pool is device memory; a dry start captures nothing."""
            return object()

        @classmethod
        @override
        def get_device_communicator_cls(cls) -> str:
            return "vllm.distributed.device_communicators.base_device_communicator." + (
                "DeviceCommunicatorBase"
            )

    return DryStartPlatform


@contextlib.contextmanager
def dry_device(
    platform: type | None = None, device_queries: Iterable[tuple[object, str, object]] = ()
) -> Iterator[list]:
    """Everything a dry start answers in place of the device and the other ranks, for the
    block, each original restored after it; yields the layout list `vllm_classes`' worker fills.

    - vLLM's platform: `dry_platform(platform)`; on a table device, torch's device queries
      (`device_queries`, from `table.device_queries`);
    - the other ranks: every process group the ranks would form (NCCL, gloo) is PyTorch's fake
      one, the tensor-parallel group has no shared-memory broadcaster (it would wait for the
      other ranks), and which ranks share a node is answered from the deployment's layout
      (vLLM's `in_the_same_node_as` broadcasts a shared-memory name from the source rank; on a
      fake group the receiving ranks would unpickle uninitialised memory): ranks fill their
      nodes in order, `world_size / nnodes` each, as vLLM's multi-node launch does;
    - vLLM inspects model classes in this process instead of a subprocess (which would not see
      this platform).
    """
    from unittest import mock

    import vllm.platforms

    with contextlib.ExitStack() as stack:
        # First: vLLM's modules read the platform and the device as they are imported.
        for owner, name, value in [
            (vllm.platforms, "current_platform", dry_platform(platform)()),
            *device_queries,
        ]:
            stack.enter_context(mock.patch.object(owner, name, value))
        layout: list = []
        stack.enter_context(other_ranks_and_inspection(layout))
        yield layout


@contextlib.contextmanager
def other_ranks_and_inspection(layout: list) -> Iterator[None]:
    """`dry_device`'s other ranks and in-process model inspection, restored after the block."""
    from unittest import mock

    import torch.distributed as dist

    from vllm.distributed import parallel_state
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    from vllm.model_executor.models import registry

    new_group = dist.new_group
    probe = parallel_state.in_the_same_node_as

    def fake_group(*args, **kwargs):
        kwargs["backend"] = "fake"
        return new_group(*args, **kwargs)

    def no_broadcaster(cls, *args, **kwargs) -> None:
        return None

    def same_node_as(pg, source_rank: int = 0) -> list[bool]:
        parallel_config = layout[-1]
        per_node = parallel_config.world_size_across_dp // parallel_config.nnodes
        if isinstance(pg, dist.ProcessGroup):
            ranks = dist.get_process_group_ranks(pg)
        else:
            ranks = list(range(pg.world_size))
        return [r // per_node == ranks[source_rank] // per_node for r in ranks]

    replaced = [
        (dist, "new_group", fake_group),
        (MessageQueue, "create_from_process_group", classmethod(no_broadcaster)),
        (registry, "_run_in_subprocess", lambda inspect: inspect()),
    ]
    # The module's own names only: a lazy module's getattr would import on the spot.
    replaced += [
        (module, "in_the_same_node_as", same_node_as)
        for module in list(sys.modules.values())
        if vars(module).get("in_the_same_node_as") is probe
    ]
    with contextlib.ExitStack() as stack:
        for owner, name, value in replaced:
            stack.enter_context(mock.patch.object(owner, name, value))
        yield


def run(
    serve_args: list[str],
    rank: int,
    free_cases: FreeMemoryCases | None = None,
    kernel_code=None,
    platform: type | None = None,
    device_queries: Iterable[tuple[object, str, object]] = (),
) -> Report:
    """vLLM's start-up of `rank` for `serve_args` on `dry_device(platform, device_queries)`,
    every decision recorded. `kernel_code` gives the fat binaries of the vLLM the node runs
    (default: the installed one's, `kernels.installed`)."""
    with dry_device(platform, device_queries) as layout:
        return _run(serve_args, rank, free_cases, kernel_code, layout)


def _run(
    serve_args: list[str], rank: int, free_cases: FreeMemoryCases | None, kernel_code, layout
) -> Report:
    report = Report(rank)
    warning_log = WarningLog()
    report.decide("args", "vllm serve", shlex.join(serve_args))
    try:
        with step("arguments"):
            args = parse_serve_args(serve_args)
        # After vLLM's logging is configured for these arguments, as `vllm serve` does.
        logging.getLogger("vllm").addHandler(warning_log)
        with step("config"):
            config = create_config(args)
        with step("arguments"):
            check_rank(rank, config.parallel_config.world_size)
        describe_config(report, config)
        start_engine(report, config, rank, free_cases, kernel_code, layout)
        if report.not_run is None:  # the sizes below are the runner's final ones
            with step("graphs"):
                check_widest_decode_batch(config, warning_log.messages)
    except Refused as error:
        traceback.print_exception(error.error, file=sys.stderr)  # with vLLM's log, on stderr
        report.refusal = refusal(error)
    finally:
        report.warnings[:0] = warning_log.messages
    return report


def check_rank(rank: int, world_size: int) -> None:
    """The rank to play must be one of the deployment's `world_size` ranks (vLLM's count)."""
    if not 0 <= rank < world_size:
        raise RankOutsideWorld(
            f"--rank {rank} is outside the world size {world_size} of these arguments "
            f"(ranks 0 to {world_size - 1})"
        )


def start_engine(
    report: Report,
    config,
    rank: int,
    free_cases: FreeMemoryCases | None,
    kernel_code=None,
    layout: list | None = None,
) -> None:
    """vLLM's engine core for `config`, this rank's worker in it."""
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.engine.core import EngineCore

    if config.use_v2_model_runner and not HAS_TRITON:  # vLLM's own condition for V2
        report.not_run = (
            "the V2 model runner needs Triton with a CUDA driver, and vllm/triton_utils/"
            "importing.py found none here (HAS_TRITON is False), so its start-up (runner, "
            "upstream's DSpark speculator, KV cache, graph plan) stops after the config; the "
            "node's dry start (preflight) runs the rest"
        )
        return
    classes = vllm_classes(rank, free_cases, [] if layout is None else layout)
    config.parallel_config.worker_cls = f"{__name__}.DryWorker"
    config.load_config.load_format = DRY_LOAD_FORMAT
    with step("engine"), meta_device():
        core = EngineCore(config, classes["DryExecutor"], log_stats=False)
    try:
        describe_engine(report, config, core)
    except AttributeError as error:  # a runner laid out otherwise (V2): say what is missing
        report.warnings.append(f"the report stops short: {error}")
    with step("graphs"):
        check_draft_graphs(core.model_executor.driver_worker.worker.model_runner)
    check_kernel_code(report, config, core, kernel_code)
    walk_warmup(report, config, core, on_node=free_cases is None)


def walk_warmup(report: Report, config, core, on_node: bool) -> None:
    """vLLM's warm-up and capture phase, each device step listed with what it needs; on the
    node, what the image lacks for the compilers that must run stops the start."""
    try:  # in the image, the project root is the working directory
        from tools.dry_start import kernels, warmup
    except ImportError as error:
        report.warnings.append(f"warm-up not walked: {error}")
        return
    try:
        steps = warmup.walk(core.model_executor.driver_worker.worker)
    except Exception as error:  # a step this walk does not record: say where it stopped
        traceback.print_exc(file=sys.stderr)
        report.warnings.append(f"the warm-up walk stopped: {type(error).__name__}: {error}")
        return
    warmup.describe(report, steps)
    if not on_node:
        report.decide("warm-up", "needs", "checked in the image on each node (preflight)")
        return
    runner = core.model_executor.driver_worker.worker.model_runner
    launched = {s.name for _, s in kernels.launched(config, runner) if isinstance(s, kernels.Jit)}
    with step("warm-up"):
        problems = list(warmup.missing_needs(steps, launched))
        if problems:
            raise warmup.MissingNeeds("; ".join(problems))


def check_kernel_code(report: Report, config, core, kernel_code) -> None:
    """The kernel libraries the built model launches, against the code the image carries."""
    from vllm.platforms import current_platform

    try:  # in the image, the project root is the working directory
        from tools.dry_start import kernels
    except ImportError as error:
        report.warnings.append(f"kernel code not checked: {error}")
        return
    runner = core.model_executor.driver_worker.worker.model_runner
    capability = current_platform.get_device_capability()
    assert capability is not None, "install_platform answers the device's capability"
    device = (capability.major, capability.minor)
    with step("kernels"):
        uses = list(kernels.launched(config, runner))
        kernels.describe_kernels(report, uses, device, (kernel_code or kernels.installed)())


def describe_config(report: Report, config) -> None:
    import vllm
    from vllm.platforms import current_platform

    model, cache, scheduler = config.model_config, config.cache_config, config.scheduler_config
    capability = current_platform.get_device_capability()
    decide = lambda name, value: report.decide("config", name, value)  # noqa: E731
    decide("vllm", vllm.__version__)
    decide("device", f"{current_platform.get_device_name()}, capability {capability}")
    decide("model runner", "V2" if config.use_v2_model_runner else "V1")
    decide("architecture", model.architecture)
    decide("quantization", model.quantization)
    decide("dtype", model.dtype)
    decide(
        "tensor parallel",
        f"{config.parallel_config.tensor_parallel_size} over "
        f"{config.parallel_config.nnodes} node(s)",
    )
    decide("max_model_len", model.max_model_len)
    decide("max_num_seqs", scheduler.max_num_seqs)
    decide("max_num_batched_tokens", scheduler.max_num_batched_tokens)
    decide("async scheduling", scheduler.async_scheduling)
    decide("prefix caching", cache.enable_prefix_caching)
    decide("kv cache dtype", cache.cache_dtype)
    speculative = config.speculative_config
    if speculative is not None:
        draft = speculative.draft_model_config
        decide(
            "speculative",
            f"{speculative.method}, k={speculative.num_speculative_tokens}, "
            f"draft {draft.architecture if draft else None}, "
            f"sampling {speculative.draft_sample_method}",
        )
    compilation = config.compilation_config
    decide("compilation mode", compilation.mode.name)
    decide("cudagraph mode (config)", compilation.cudagraph_mode.name)
    decide("capture sizes (config)", compilation.cudagraph_capture_sizes)


# Attributes in which vLLM's quantisation methods keep the kernel or backend they chose.
CHOICE_ATTRIBUTES = ("mxfp4_backend", "nvfp4_backend", "fp8_backend", "experts_cls", "fp8_linear")


def _name(obj) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return obj.name if isinstance(obj, enum.Enum) else cls.__name__


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB // 10 else f"{nbytes / 2**20:.1f} MiB"


def _unwrap(model):
    """The model inside vLLM's CUDA-graph wrappers."""
    return model.unwrap() if hasattr(model, "unwrap") else model


def _storages(tensors) -> dict[int, int]:
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage._cdata] = storage.nbytes()
    return storages


def _module_storages(module) -> dict[int, int]:
    return _storages([*module.parameters(), *module.buffers()])


def device_tensors(obj, path: str, depth: int = 3) -> Iterator[tuple[str, Any]]:
    """The tensors a DSpark object holds (not a module's weights), by attribute path."""
    import torch

    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            yield f"{path}.{name}", value
        elif (
            depth > 0
            and not isinstance(value, torch.nn.Module)
            and type(value).__module__.startswith("vllm.v1.spec_decode.dspark")
        ):
            yield from device_tensors(value, f"{path}.{name}", depth - 1)


def describe_engine(report: Report, config, core) -> None:
    from collections import Counter

    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    worker = core.model_executor.driver_worker.worker
    runner = worker.model_runner
    target = _unwrap(runner.get_model())
    report.decide("model", "target", _name(target))
    layers = get_layers_from_vllm_config(config, AttentionLayerBase)  # type: ignore[type-abstract]
    attention: Counter[tuple[str, str, str]] = Counter()
    for layer in layers.values():
        spec = layer.get_kv_cache_spec(config)
        layout = (
            f"{getattr(layer, 'kv_cache_dtype', config.cache_config.cache_dtype)} KV, "
            f"{_name(spec)} of {spec.page_size_bytes} B per {spec.block_size}-token block"
            if spec is not None
            else "no KV cache"
        )
        attention[(_name(layer), layer.get_attn_backend().get_name(), layout)] += 1
    for (layer_name, backend, layout), count in attention.items():
        report.decide("model", f"attention {layer_name} x{count}", f"{backend}: {layout}")
    methods: Counter[tuple[str, str, str]] = Counter()
    for module in target.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            choices = [
                f"{name} {_name(getattr(method, name))}"
                for name in CHOICE_ATTRIBUTES
                if getattr(method, name, None) is not None
            ]
            methods[(_name(module), _name(method), ", ".join(choices))] += 1
    for (module_name, method_name, chosen), count in methods.items():
        report.decide(
            "model",
            f"{module_name} x{count}",
            method_name + (f" ({chosen})" if chosen else ""),
        )
    describe_draft(report, runner, target)
    describe_memory(report, config, worker, runner)
    describe_graphs(report, config, runner)


def describe_draft(report: Report, runner, target) -> None:
    drafter = getattr(runner, "drafter", None)
    if drafter is None:
        return
    report.decide("draft", "proposer", _name(drafter))
    model = getattr(drafter, "model", None)
    if model is not None:
        model = _unwrap(model)
        shared = _module_storages(target)
        own = {k: v for k, v in _module_storages(model).items() if k not in shared}
        report.decide(
            "draft", "draft model", f"{_name(model)}, {_gib(sum(own.values()))} of its own"
        )
    seen = set()
    for path, tensor in device_tensors(drafter, "proposer"):
        storage = tensor.untyped_storage()._cdata
        if storage not in seen and tensor.nbytes >= 2**20:
            seen.add(storage)
            report.decide(
                "draft", path, f"{tuple(tensor.shape)} {tensor.dtype}, {_gib(tensor.nbytes)}"
            )


def describe_memory(report: Report, config, worker, runner) -> None:
    memory = worker.dry_memory
    kv = runner.kv_cache_config
    cache = config.cache_config
    target = _module_storages(_unwrap(runner.get_model()))
    decide = lambda name, value: report.decide("memory", name, value)  # noqa: E731
    decide("device memory", _gib(worker.init_snapshot.total_memory))
    decide(
        "requested",
        f"{_gib(memory['requested'])} (gpu_memory_utilization {cache.gpu_memory_utilization})",
    )
    decide("target weights", _gib(sum(target.values())))
    decide("draft weights and every buffer", _gib(memory["held"] - sum(target.values())))
    decide("KV budget (activation peak not measured)", _gib(memory["requested"] - memory["held"]))
    describe_free_memory(report, config, worker, memory["held"])
    report.decide("kv cache", "layout", cache.kv_cache_layout)
    for group in kv.kv_cache_groups:
        spec = group.kv_cache_spec
        report.decide(
            "kv cache",
            f"group of {len(group.layer_names)} layers",
            f"{_name(spec)}, block {spec.block_size}, page {spec.page_size_bytes} B",
        )
    report.decide("kv cache", "blocks", kv.num_blocks)
    report.decide("kv cache", "tokens", f"{cache.kv_cache_size_tokens:,}")
    report.decide(
        "kv cache",
        f"max concurrency at {config.model_config.max_model_len:,} tokens",
        f"{cache.kv_cache_max_concurrency:.2f}",
    )


def describe_free_memory(report: Report, config, worker, held: int) -> None:
    """vLLM's verdict at each free memory figure the rank was measured at: the KV budget and
    the concurrency it leaves, and on a unified-memory device what stays for the host."""
    from vllm.platforms import current_platform

    cache = config.cache_config
    unified = current_platform.is_integrated_gpu(0)
    for case in worker.memory_cases:
        name = f"at {_gib(case.free)} free ({case.label})"
        if case.requested is None:
            report.decide("memory", name, f"refused: {case.refusal}")
            continue
        budget = case.requested - held
        verdict = f"starts, KV budget {_gib(budget)}"
        if case.requested == worker.requested_memory:  # the budget the engine sized the cache for
            verdict += (
                f", max concurrency at {config.model_config.max_model_len:,} tokens "
                f"{cache.kv_cache_max_concurrency:.2f}"
            )
        if unified:
            verdict += f", {_gib(case.free - case.requested)} left for the host"
        report.decide("memory", name, verdict)


def describe_graphs(report: Report, config, runner) -> None:
    """The target's captures as the runner's dispatcher holds them, and the draft's as the
    DSpark proposer plans them from those final sizes."""
    compilation = config.compilation_config
    report.decide("graphs", "cudagraph mode", compilation.cudagraph_mode.name)
    report.decide("graphs", "capture sizes", compilation.cudagraph_capture_sizes)
    for mode, descriptors in runner.cudagraph_dispatcher.get_capture_descs():
        sizes = sorted({d.num_tokens for d in descriptors})
        report.decide("graphs", f"target {mode.name} captures (tokens)", sizes)
    drafter = getattr(runner, "drafter", None)
    if drafter is None or not hasattr(drafter, "initialize_cudagraph_keys"):
        return
    runner_modes = {mode for mode, _ in runner.cudagraph_dispatcher.get_capture_descs()}
    forward = sorted(
        {
            d.num_tokens
            for mode, descriptors in drafter.cudagraph_dispatcher.get_capture_descs()
            if mode in runner_modes  # the runner captures the drafter's keys in its passes
            for d in descriptors
        }
    )
    report.decide("graphs", "draft forward PIECEWISE (tokens)", forward)
    graphs = getattr(drafter, "draft_graphs", None)  # DSpark's FULL graphs
    report.decide("graphs", "draft FULL (requests)", list(graphs.sizes) if graphs else [])
    if graphs is not None:
        report.decide("graphs", "draft FULL variants", ", ".join(graphs.variants))


class UngraphedDraftStep(ValueError):
    """A decode batch the target replays as a FULL graph drafts without one."""

    fix = (
        "the proposer must plan its draft graphs from the runner's final capture sizes "
        "(in initialize_cudagraph_keys, after vLLM's spec-decode rounding)"
    )


def check_draft_graphs(runner) -> None:
    """Refuse a draft whose FULL graphs miss a request count the target's FULL graphs hold:
    a decode batch padded to that target graph would draft eagerly. Both plans are read from
    the objects the runner and the proposer built."""
    from vllm.config import CUDAGraphMode

    drafter = getattr(runner, "drafter", None)
    if drafter is None or not hasattr(drafter, "initialize_cudagraph_keys"):
        return
    if not hasattr(drafter, "draft_graphs"):
        return  # not a DSpark proposer
    held = {
        d.num_reqs
        for mode, descriptors in runner.cudagraph_dispatcher.get_capture_descs()
        if mode == CUDAGraphMode.FULL
        for d in descriptors
        if d.uniform and d.num_reqs
    }
    graphs = drafter.draft_graphs
    missing = sorted(held - set(graphs.sizes if graphs else ()))
    if missing:
        raise UngraphedDraftStep(
            f"the target's FULL decode graphs hold {sorted(held)} requests, the draft's FULL "
            f"graphs {list(graphs.sizes) if graphs else []}: batches of {missing} requests "
            "would draft without a graph"
        )


class UncoveredDecodeBatch(ValueError):
    """The target's largest CUDA graph cannot hold a decode step of every request."""

    fix = (
        "leave --max-cudagraph-capture-size and cudagraph_capture_sizes to vLLM (its default "
        "covers max_num_seqs x (num_speculative_tokens + 1)), or set a size at least that wide"
    )


def check_widest_decode_batch(config, vllm_warnings: list[str]) -> None:
    """Refuse graphs that leave the widest speculative decode step eager: a decode step of
    `max_num_seqs` requests verifies k + 1 tokens each, and a step wider than the largest
    captured size runs without the target's CUDA graphs."""
    from vllm.config import CUDAGraphMode

    compilation = config.compilation_config
    if compilation.cudagraph_mode == CUDAGraphMode.NONE or not compilation.cudagraph_capture_sizes:
        return
    speculative = config.speculative_config
    per_request = 1 + (speculative.num_speculative_tokens if speculative is not None else 0)
    widest = config.scheduler_config.max_num_seqs * per_request
    largest = max(compilation.cudagraph_capture_sizes)
    if largest >= widest:
        return
    rewrites = [w for w in vllm_warnings if "capture_size" in w or "capture size" in w]
    raise UncoveredDecodeBatch(
        f"the largest cudagraph_capture_sizes entry after vLLM's adjustments is {largest} "
        f"tokens, below the widest decode step, max_num_seqs x (num_speculative_tokens + 1) "
        f"= {widest} tokens, which would run without CUDA graphs"
        + "".join(f"; vLLM: {w}" for w in rewrites)
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rank", type=int, default=0, help="the rank to play (default 0)")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="the rank's environment, set before vLLM is imported",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "serve_args", nargs=argparse.REMAINDER, help="-- then the rank's `vllm serve` arguments"
    )
    options = parser.parse_args(argv)
    for item in options.env:
        name, _, value = item.partition("=")
        os.environ[name] = value
    serve_args = options.serve_args[1:] if options.serve_args[:1] == ["--"] else options.serve_args

    def start() -> Report:
        return run(serve_args, options.rank)

    return report_and_exit(start, options.json)


def finish(status: int) -> None:
    """Exit with `status` and no interpreter teardown, where compiled extensions report leaks
    after the verdict; child processes vLLM started go first."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def report_and_exit(start: Callable[[], Report], as_json: bool) -> int:
    """Run `start` with vLLM's logs on stderr; the report is the last thing on stdout."""
    with contextlib.redirect_stdout(sys.stderr):
        report = start()
    if as_json:
        print(json.dumps(report.as_json()))
    else:
        print("\n".join(report.lines()))
    if report.ok:
        return 0
    assert report.refusal is not None
    return 2 if report.refusal.step in ARGUMENT_STEPS else 1


if __name__ == "__main__":
    finish(main(sys.argv[1:]))
