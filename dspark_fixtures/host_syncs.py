# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Count what makes the host wait for the device on a GPU.

On a CPU run nothing waits, but the same calls still happen, so counting them inside a step
shows which code would synchronize once its tensors live on a GPU. Two recorders:

* ``HostSyncRecorder`` (a dispatch mode): the aten ops whose result the host needs (``.item()``,
  data-dependent shapes such as ``nonzero``). Without host storages it counts them on every
  tensor, vLLM's host-side ``*_cpu`` copies included: a count is an upper bound.
* ``DeviceReadRecorder`` (a function mode): device-to-host reads (``.tolist()``, ``.numpy()``,
  ``.item()``, ``.cpu()``, ``.to("cpu")``, a blocking ``copy_`` into a host tensor, ``bool`` /
  ``int`` / ``float`` of a tensor) of tensors that live on the device on a GPU, and calls of
  ``torch.cuda.synchronize`` / ``torch.accelerator.synchronize``.

A CPU box has one device, so which tensors are host tensors is read from vLLM's runner when a
step starts: the host halves of its ``CpuGpuBuffer``s and its (and its input batch's, block
tables' and drafter's) tensors whose names say host (``*_cpu``, ``*_cpu_tensor``, ``*pinned*``);
what ops compute from host tensors only stays on the host. The CPU runner makes a buffer's
device half its host half, so a read of such a device buffer counts as a host read; waits on
CUDA events and streams are not seen (the CPU runner replaces them). ``step_reads`` records
each engine step: ``execute_model``, ``sample_tokens`` and ``take_draft_token_ids``.
"""

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

SYNCING_OPS = {
    "_local_scalar_dense",  # .item(), bool(tensor), int(tensor)
    "is_nonzero",
    "nonzero",
    "argwhere",
    "masked_select",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "bincount",
    "repeat_interleave",
    "equal",
}

IsHost = Callable[[torch.Tensor], bool]


class HostSyncRecorder(TorchDispatchMode):
    """Records the aten ops that make the host wait for device results on a GPU.

    With ``host_storages`` (the storages of the host tensors when recording starts), only ops
    that read a device tensor count; an op's outputs are host tensors when all its tensor inputs
    are (so ``host_tensor[1:] - host_tensor[:-1]`` stays on the host), device tensors otherwise
    (factories included: on a CPU box the two are one device)."""

    def __init__(self, host_storages: set[int] | None = None) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self._registered = host_storages
        self._derived: set[int] = set()

    def is_host(self, tensor: torch.Tensor) -> bool:
        if self._registered is None:
            return False
        storage = tensor.untyped_storage().data_ptr()
        return storage in self._registered or storage in self._derived

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_host = bool(inputs) and all(self.is_host(t) for t in inputs)
        boolean_index = name.startswith(("index", "_index_put")) and any(
            isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
            for arg in args
            if isinstance(arg, list | tuple)
            for index in arg
        )
        if (name in SYNCING_OPS or boolean_index) and not on_host:
            self.syncs.append(name)
        out = func(*args, **kwargs)
        if self._registered is not None:
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage().data_ptr()
                    if on_host:
                        self._derived.add(storage)
                    else:
                        # A device tensor, perhaps where a freed host one was.
                        self._derived.discard(storage)
        return out


# Tensor methods that hand a tensor's values to the host.
_READS = {
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.item,
    torch.Tensor.cpu,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}
_MOVES = {torch.Tensor.cpu, torch.Tensor.to}
_CHAINED = _READS - _MOVES
_READ_OPS = {"_local_scalar_dense", "is_nonzero"}
_TORCH_DIR = str(Path(torch.__file__).parent)


def _call_site() -> str:
    """``file:line function`` of the first caller outside torch and this module."""
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_filename.startswith((_TORCH_DIR, __file__)):
        frame = frame.f_back
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}"


def _to_host(args, kwargs) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` moves to the CPU, blocking."""
    if kwargs.get("non_blocking"):
        return False
    targets = [*args[1:], kwargs.get("device")]
    return any(
        (isinstance(t, str | torch.device) and torch.device(t).type == "cpu")
        or (isinstance(t, torch.Tensor) and t.device.type == "cpu")
        for t in targets
    )


class DeviceReadRecorder(TorchFunctionMode):
    """Records device-to-host reads of tensors ``is_host`` does not call host tensors, and
    device-wide waits, as ``"method at file:line function"``."""

    def __init__(self, is_host: IsHost) -> None:
        super().__init__()
        self.reads: list[str] = []
        self._is_host = is_host
        self._moved_at: str | None = None
        self._patched: list[tuple[object, str, object]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._device_read(func, args, kwargs):
            site = _call_site()
            # ``t.cpu().numpy()``: on a GPU the second call reads the host copy; here the copy
            # is the tensor itself.
            if not (func in _CHAINED and self._moved_at == site):
                self.reads.append(f"{func.__name__} at {site}")
            self._moved_at = site if func in _MOVES else None
        return func(*args, **kwargs)

    def _device_read(self, func, args, kwargs) -> bool:
        if not args or not isinstance(args[0], torch.Tensor):
            return False
        if func is torch.Tensor.copy_:
            source = args[1]
            non_blocking = kwargs.get("non_blocking", len(args) > 2 and args[2])
            return (
                not non_blocking
                and self._is_host(args[0])
                and isinstance(source, torch.Tensor)
                and not self._is_host(source)
            )
        if self._is_host(args[0]):
            return False
        return func in _READS or (func is torch.Tensor.to and _to_host(args, kwargs))

    def __enter__(self):
        for module in (torch.cuda, torch.accelerator):
            wait = module.synchronize
            self._patched.append((module, "synchronize", wait))
            module.synchronize = self._recorded_wait(wait)
        return super().__enter__()

    def __exit__(self, *exc):
        while self._patched:
            module, name, original = self._patched.pop()
            setattr(module, name, original)
        return super().__exit__(*exc)

    def _recorded_wait(self, wait):
        def recorded(*args, **kwargs):
            self.reads.append(f"synchronize at {_call_site()}")
            return wait(*args, **kwargs)

        return recorded


def runner_host_storages(runner) -> set[int]:
    """Storages of the runner's host tensors (see the module docstring)."""
    from vllm.v1.utils import CpuGpuBuffer

    owners = [runner, runner.input_batch, *runner.input_batch.block_table.block_tables]
    if getattr(runner, "drafter", None) is not None:
        owners.append(runner.drafter)
    storages = set()
    for owner in owners:
        for name, value in vars(owner).items():
            if isinstance(value, CpuGpuBuffer):
                value = value.cpu
            elif not (
                isinstance(value, torch.Tensor)
                and (name.endswith(("_cpu", "_cpu_tensor")) or "pinned" in name)
            ):
                continue
            storages.add(value.untyped_storage().data_ptr())
    return storages


@dataclass
class StepReads:
    """What one engine step read from the device."""

    decoding: bool
    """Every scheduled request verified drafts (a steady-state step)."""
    reads: list[str] = field(default_factory=list)
    syncs: list[str] = field(default_factory=list)


@contextlib.contextmanager
def step_reads(runner) -> Iterator[list[StepReads]]:
    """Record every step the runner runs inside: its ``execute_model``, ``sample_tokens`` and
    ``take_draft_token_ids`` under both recorders, with the runner's host tensors as host."""
    host = runner_host_storages(runner)
    steps: list[StepReads] = []

    def recorded(name: str):
        method = getattr(runner, name)

        def call(*args, **kwargs):
            if name == "execute_model":
                scheduled = args[0].num_scheduled_tokens
                decoding = set(args[0].scheduled_spec_decode_tokens) == set(scheduled)
                steps.append(StepReads(decoding=bool(scheduled) and decoding))
            if not steps:
                return method(*args, **kwargs)
            syncs = HostSyncRecorder(host)
            with DeviceReadRecorder(syncs.is_host) as reads, syncs:
                result = method(*args, **kwargs)
            steps[-1].reads += reads.reads
            # .item() and bool() are reads already.
            steps[-1].syncs += [op for op in syncs.syncs if op not in _READ_OPS]
            return result

        return call

    names = ("execute_model", "sample_tokens", "take_draft_token_ids")
    own = {name: vars(runner)[name] for name in names if name in vars(runner)}
    for name in names:
        setattr(runner, name, recorded(name))
    try:
        yield steps
    finally:
        for name in names:
            if name in own:
                setattr(runner, name, own[name])
            else:
                delattr(runner, name)
