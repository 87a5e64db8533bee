# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The target device from a table, for a dry start on a host without it (a CPU, in CI).

What a GPU host's driver, CUDA libraries and device answer, answered here instead; everything
else the dry start runs is vLLM's code:
- vLLM's compiled CUDA extensions (the `.so` files its wheel's RECORD lists and this tree lacks)
  import as stand-ins; their PyTorch operators are defined from the schemas in the wheel's
  binaries, without kernels (none runs in a dry start);
- the CUDA kernel packages the wheel pins (FlashInfer, TileLang, CuTe DSL, ...) import as
  stand-ins whose every name is a placeholder, as present as in the image; a number one of them
  would compute (a workspace size) counts as 0;
- the capability queries vLLM's CUDA library answers (`cutlass_scaled_mm_supports_fp8`, ...)
  answer from the table's capability and the images' CUDA version, as the library's source does;
- `CudaPlatform`'s and torch's device queries (capability, name, memory, SM count, integrated
  memory, current device) answer from the table; no memory is pinned; CUDA streams and events
  are inert;
- free memory: torch's `get_memory_info` answers the figure `answer_free` set, and on an
  integrated-memory device the host's memory is the device's (psutil's `virtual_memory`, which
  vLLM's `MemorySnapshot` reads there), so vLLM's own rules measure and decide.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import json
import re
import sys
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
# The CUDA runtime of the 0.33.0 images (CUDA 13.0), as CUDA_VERSION reads it.
IMAGE_CUDA_VERSION = 13000


@dataclass(frozen=True)
class FreeAtBoot:
    """The free memory an integrated-memory device reports at boot, its memory shared with the
    operating system: the lowest and highest figures of the public reports, and a typical one."""

    worst: int
    typical: int
    best: int


@dataclass(frozen=True)
class Device:
    name: str
    capability: tuple[int, int]
    memory_bytes: int  # the total torch reports (`total_memory`)
    sm_count: int
    free_at_boot: FreeAtBoot | None = None  # an integrated-memory device's; else free = total

    @property
    def integrated(self) -> bool:
        return self.free_at_boot is not None

    def free_memory_cases(self) -> list[tuple[str, int]]:
        """The free memory figures a dry start plays, the one that decides first."""
        if self.free_at_boot is None:
            return [("free = total", self.memory_bytes)]
        return [("worst", self.free_at_boot.worst), ("typical", self.free_at_boot.typical)]


MIB = 1 << 20


def _gib(figure: float) -> int:
    return round(figure * GIB)


# Memory as torch reports it where known (GB10), else as the driver reports it (nvidia-smi's
# MiB) or the nominal size. A GB10's 121.69 GiB is unified memory shared with its CPU; Spark
# owners report 101.3-102.2 GiB of it free at boot (docs/dry-start.md). Preflight asks the
# real device.
DEVICES = {
    "gb10": Device(
        "NVIDIA GB10",
        (12, 1),
        _gib(121.69),
        48,
        free_at_boot=FreeAtBoot(_gib(101.3), _gib(101.8), _gib(102.2)),
    ),
    "b200": Device("NVIDIA B200", (10, 0), 183359 * MIB, 148),
    "b300": Device("NVIDIA B300", (10, 3), 288 * 10**9, 160),
    "rtx-pro-6000": Device("NVIDIA RTX PRO 6000 Blackwell", (12, 0), 97887 * MIB, 188),
}

# Import name -> the distribution the vLLM wheel pins that brings it (its METADATA's
# Requires-Dist; CUDA Python comes with the CuTe DSL).
KERNEL_PACKAGES = {
    "cuda": "nvidia-cutlass-dsl",
    "flashinfer": "flashinfer-python",
    "flashinfer_cubin": "flashinfer-python",
    "tilelang": "tilelang",
    "cutlass": "nvidia-cutlass-dsl",
    "quack": "quack-kernels",
    "tokenspeed_mla": "tokenspeed-mla",
    "humming": "humming-kernels",
    "cudnn": "nvidia-cudnn-frontend",
}


# vLLM's CUDA extensions that register PyTorch operators (the flash-attention ones are looked up
# only when they run).
OP_LIBRARIES = (
    "_C_stable_libtorch",
    "_moe_C_stable_libtorch",
    "_flashmla_C",
    "_flashmla_extension_C",
    "_qutlass_C",
    "_deepselect_C",
    "_flashkda_C",
)


# Python modules that only load a compiled extension and bind its operators -> the extension.
EXTENSION_LOADERS = {"vllm.third_party.deep_gemm._C": "vllm.third_party.deep_gemm._C_extension"}


def capability_queries(capability: int) -> dict[str, bool]:
    """What vLLM's CUDA library answers for `capability` (its `scaled_mm_entry.cu` and
    `nvfp4_scaled_mm_entry.cu`), built with the images' CUDA."""
    cuda = IMAGE_CUDA_VERSION
    return {
        "cutlass_scaled_mm_supports_fp8": (capability >= 90 and cuda >= 12000)
        or (capability >= 89 and cuda >= 12040),
        "cutlass_scaled_mm_supports_block_fp8": (capability >= 100 and cuda >= 12080)
        or (90 <= capability < 100 and cuda >= 12000),
        "cutlass_group_gemm_supported": (capability >= 100 and cuda >= 12080)
        or (90 <= capability < 100 and cuda >= 12030),
        "cutlass_scaled_mm_supports_fp4": capability >= 100 and cuda >= 12080,
    }


class _Placeholder(type):
    """A name of a stand-in kernel package: usable as a base class, a type, a decorator or a
    value."""

    def __getattr__(cls, name: str):
        return _placeholder(name)

    def __getitem__(cls, item):
        return cls

    def __iter__(cls):
        return iter(())  # lists nothing: no runtime library to preload

    def __index__(cls) -> int:
        return 0  # a size the package computes (a workspace): nothing held in a dry start

    __int__ = __index__

    def __lt__(cls, other) -> bool:
        return other > 0

    def __le__(cls, other) -> bool:
        return other >= 0

    def __gt__(cls, other) -> bool:
        return other < 0

    def __ge__(cls, other) -> bool:
        return other <= 0

    def __add__(cls, other):
        return other

    __radd__ = __add__

    def __mul__(cls, other) -> int:
        return 0

    __rmul__ = __mul__

    def __contains__(cls, item) -> bool:
        return True  # a probe of what the package ships: as present as in the image

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        return cls


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports the top-level `packages` (name -> version) and their submodules, and the
    `modules`, as stand-ins whose every public name is a placeholder."""

    def __init__(self, packages: dict[str, str], modules: set[str]) -> None:
        self.packages = packages
        self.modules = modules

    def find_spec(self, fullname, path, target=None):
        stand_in = fullname.split(".")[0] in self.packages or any(
            fullname == module or fullname.startswith(module + ".") for module in self.modules
        )
        if stand_in:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        vars(module).update(
            __version__=self.packages.get(spec.name.split(".")[0], ""), __getattr__=_placeholder
        )
        return module

    def exec_module(self, module) -> None:
        pass


def _placeholder(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(name, (), {})


def missing_extensions(vllm_root: Path, record: Path) -> set[str]:
    """vLLM's compiled extensions its wheel's RECORD lists and this tree lacks, with the Python
    modules that do nothing but load one of them and forward its operators."""
    missing = set()
    for line in record.read_text().splitlines():
        path = line.split(",", 1)[0]
        if path.endswith(".so") and not (vllm_root.parent / path).exists():
            missing.add(path.split(".", 1)[0].replace("/", "."))
    return missing | {loader for loader, so in EXTENSION_LOADERS.items() if so in missing}


def pinned_kernel_packages(requirements: list[str]) -> dict[str, str]:
    """The kernel packages the wheel pins (its METADATA's unconditional Requires-Dist), import
    name -> pinned version ("" when only a lower bound is given)."""
    from packaging.requirements import Requirement

    pinned = {}
    for line in requirements:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate():
            exact = [s.version for s in requirement.specifier if s.operator == "=="]
            pinned[requirement.name] = exact[0] if exact else ""
    return {
        name: pinned[distribution]
        for name, distribution in KERNEL_PACKAGES.items()
        if distribution in pinned
    }


def install(device: Device, wheel: Path) -> type:
    """Stand in for vLLM's CUDA extensions and kernel packages and define its operators; call
    before vLLM is imported. Returns vLLM's CUDA platform class answering from `device` (for
    `engine.run`, with `device_queries`)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None, "no vLLM on this Python"
    vllm_root = Path(spec.origin).parent
    distribution = importlib.metadata.distribution("vllm")
    record = Path(str(distribution.locate_file(f"vllm-{distribution.version}.dist-info/RECORD")))
    extensions = missing_extensions(vllm_root, record)
    packages = pinned_kernel_packages(distribution.requires or [])
    sys.meta_path.insert(0, _StandInFinder(packages, extensions))
    _define_operators(operator_schemas(wheel, vllm_root), device)
    return _table_platform(device)


def operator_schemas(wheel: Path, vllm_root: Path) -> dict[str, list[str]]:
    """Namespace -> the operator schemas vLLM's CUDA extensions in `wheel` define, read from the
    binaries' strings (cached beside the wheel). An operator goes to the namespace vLLM's Python
    calls it in, else the one its library is named after."""
    cache = wheel.with_name(wheel.name + ".operators.json")
    if cache.is_file():
        return json.loads(cache.read_text())
    import torch

    used: dict[str, str] = {}
    for path in vllm_root.rglob("*.py"):
        text = path.read_text(errors="replace")
        for namespace, name in re.findall(r"torch\.ops\.(\w+)\.(\w+)", text):
            used.setdefault(name, namespace)
    schemas: dict[str, list[str]] = {}
    with zipfile.ZipFile(wheel) as archive:
        for library in OP_LIBRARIES:
            member = f"vllm/{library}.abi3.so"
            if member not in archive.namelist():
                continue
            default = library.removesuffix("_stable_libtorch")
            for piece in archive.read(member).split(b"\0"):
                if b") -> " not in piece or len(piece) > 4096:
                    continue
                text = " ".join(piece.decode("latin-1").split())
                try:
                    name = torch._C.parse_schema(text).name
                except RuntimeError:
                    continue
                schemas.setdefault(used.get(name, default), []).append(text)
    cache.write_text(json.dumps(schemas, indent=1, sort_keys=True))
    return schemas


def _define_operators(schemas: dict[str, list[str]], device: Device) -> None:
    """vLLM's CUDA operators, defined without kernels; the capability queries among them answer
    from the table."""
    import torch

    capability = device.capability[0] * 10 + device.capability[1]
    answers = capability_queries(capability)
    for namespace, definitions in schemas.items():
        library = torch.library.Library(namespace, "FRAGMENT")
        for schema in sorted(set(definitions)):
            library.define(schema)
        for name, answer in answers.items():
            if any(schema.startswith(f"{name}(") for schema in definitions):
                library.impl(name, lambda _c, answer=answer: answer, "CompositeExplicitAutograd")
        _LIBRARIES.append(library)  # a Library unregisters its operators when collected


_LIBRARIES: list = []


class _InertStream:
    """A CUDA stream or event with nothing to order: no kernel runs in a dry start."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: True


def device_queries(device: Device) -> list[tuple[object, str, object]]:
    """torch's own questions to the driver, answered from the table; streams and events are
    inert: (owner, name, replacement) for `engine.dry_device` to set and restore."""
    import psutil
    import torch

    properties = types.SimpleNamespace(
        name=device.name,
        major=device.capability[0],
        minor=device.capability[1],
        total_memory=device.memory_bytes,
        multi_processor_count=device.sm_count,
        is_integrated=device.integrated,
    )
    _FREE[:] = [device.free_memory_cases()[0][1]]
    host = psutil.virtual_memory

    def unified_memory():
        """The host's memory is the device's: what vLLM reads as free on an integrated GPU."""
        return host()._replace(total=device.memory_bytes, available=_FREE[0])

    return [
        (torch.cuda, "Stream", _InertStream),
        (torch.cuda, "Event", _InertStream),
        (torch.accelerator, "current_device_index", lambda: 0),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "get_device_capability", lambda device_id=None: device.capability),
        (torch.cuda, "get_device_properties", lambda device_id=None: properties),
        (torch.cuda, "get_device_name", lambda device_id=None: device.name),
        (
            torch.accelerator,
            "get_memory_info",
            lambda device_id=None: (_FREE[0], device.memory_bytes),
        ),
        (torch.accelerator, "memory_stats", lambda device_id=None: {}),
        (torch.accelerator, "memory_reserved", lambda device_id=None: 0),
        *([(psutil, "virtual_memory", unified_memory)] if device.integrated else []),
    ]


_FREE: list[int] = []


def answer_free(nbytes: int) -> None:
    """The free memory the device reports from now on."""
    _FREE[:] = [nbytes]


def _table_platform(device: Device) -> type:
    from typing_extensions import override

    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability

    # vllm.platforms.cuda picks CudaPlatform's class at import (NVML or not): a variable to mypy.
    class TableCudaPlatform(CudaPlatform):  # type: ignore[valid-type,misc]
        """vLLM's CUDA platform, its device queries answered from the table."""

        @classmethod
        @override
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(*device.capability)

        @classmethod
        @override
        def get_device_name(cls, device_id: int = 0) -> str:
            return device.name

        @classmethod
        @override
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return device.memory_bytes

        @classmethod
        @override
        def device_count(cls) -> int:
            return 1

        @classmethod
        @override
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            return False

        @classmethod
        @override
        def is_integrated_gpu(cls, device_id: int = 0) -> bool:
            return device.integrated

        @classmethod
        @override
        def num_compute_units(cls, device_id: int = 0) -> int:
            return device.sm_count

        @classmethod
        @override
        def is_pin_memory_available(cls) -> bool:
            return False

    return TableCudaPlatform
