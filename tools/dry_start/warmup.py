# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""What the real start does after the model is built, and what each step needs on the node.

vLLM's own `Worker.compile_or_warm_up_model` runs here, and with it vLLM's `kernel_warmup`:
their conditions (the compilation mode and sizes, the capability, which kernel packages and
backends the model uses) decide which steps run, as on the node. Each step that would launch
kernels is recorded instead of run: the warm-up forwards (torch.compile's Inductor compiles
Triton kernels in them), every warm-up and autotune function `kernel_warmup` calls, the JIT
kernels the model registered for warm-up, the graph captures and the sampler's warm-up. A
warm-up function decides inside from the model whether it compiles anything; the dry start
lists the call, not what it would do inside.

On the node (preflight) `missing_needs` checks what the recorded steps need in the image:
a CUDA compiler for DeepGEMM's and FlashInfer's JIT, cubins or a network for FlashInfer, a host
C compiler for Triton's launchers, and writable JIT caches.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import shutil
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from tools.gpu_selftest.architectures import find_nvcc

NVCC = "a CUDA compiler (nvcc in PATH or CUDA_HOME)"
DEEP_GEMM = f"DeepGEMM JIT: {NVCC}, or NVRTC with DG_JIT_USE_NVRTC=1; DG_JIT_CACHE_DIR"
FLASHINFER = (
    f"FlashInfer JIT or cubins: {NVCC}, or flashinfer-cubin, else a cubin download (network); "
    "FLASHINFER_WORKSPACE_BASE"
)
TRITON = "Triton JIT: its bundled ptxas and a host C compiler (cc); TRITON_CACHE_DIR"
CUTE_DSL = "CuTe DSL JIT (in-process); CUTE_DSL_CACHE_DIR"
TILELANG = "TileLang JIT; TILELANG_CACHE_DIR"
INDUCTOR = "torch.compile: Inductor's Triton kernels (a host C compiler); TORCHINDUCTOR_CACHE_DIR"
# Words in a warm-up function's name -> what it compiles with; first match wins.
NEEDS_BY_NAME = (
    ("deep_gemm", DEEP_GEMM),
    ("flashinfer", FLASHINFER),
    ("b12x", FLASHINFER),
    ("attention", FLASHINFER),  # kernel_warmup's mixed-batch warm-up is FlashInfer's
    ("triton", TRITON),
    ("tilelang", TILELANG),
    ("cutedsl", CUTE_DSL),
    ("router_gemm", CUTE_DSL),
    ("gemm_rs_ar", CUTE_DSL),
)
# The JIT caches the images point at a volume (docker/*.Dockerfile): each must be writable.
CACHE_VARIABLES = (
    "VLLM_CACHE_ROOT",
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "FLASHINFER_WORKSPACE_BASE",
    "CUTE_DSL_CACHE_DIR",
    "TILELANG_CACHE_DIR",
    "DG_JIT_CACHE_DIR",
    "CUDA_CACHE_PATH",
)
# Warm-up functions `kernel_warmup` imports inside its body, patched where they are defined.
LOCAL_WARMUPS = (
    "vllm.model_executor.warmup.minimax_m3_msa_warmup.minimax_m3_msa_warmup",
    "vllm.model_executor.warmup.step5_dsa_warmup.step5_dsa_warmup",
)


@dataclass(frozen=True)
class Step:
    phase: str
    what: str
    needs: str


def needs_of(name: str) -> str:
    name = name.lower()
    return next((needs for word, needs in NEEDS_BY_NAME if word in name), "")


def walk(worker) -> list[Step]:
    """vLLM's compile-and-warm-up of `worker` with every device step recorded, in order."""
    import vllm.model_executor.warmup.kernel_warmup as warmups
    import vllm.v1.worker.gpu_worker as gpu_worker
    from vllm.config import CompilationMode

    steps: list[Step] = []
    runner = worker.model_runner
    compiled = worker.vllm_config.compilation_config.mode == CompilationMode.VLLM_COMPILE

    def forward(num_tokens=None, *args, **kwargs):
        eager = kwargs.get("cudagraph_runtime_mode") is not None
        what = f"forward of {num_tokens} tokens" + (" (eager)" if eager else "")
        steps.append(Step("warm-up", what, INDUCTOR if compiled and not eager else ""))
        return None, None

    def recorder(phase: str, name: str, needs: str):
        def record(*args, **kwargs):
            steps.append(Step(phase, name, needs))

        return record

    def tripwire(name: str, function):
        """The warm-up function itself: one that returns here did nothing for this model; one
        that stops reached its kernels. FlashInfer's and DeepGEMM's are stand-ins here, so
        vLLM's call to them is recorded instead."""
        needs = needs_of(name)
        if needs in (FLASHINFER, DEEP_GEMM) or not needs:
            return recorder("jit", name, needs)

        def run(*args, **kwargs):
            try:
                function(*args, **kwargs)
            except Exception:
                steps.append(Step("jit", name, needs))

        return run

    def capture() -> int:
        for mode, descriptors in runner.cudagraph_dispatcher.get_capture_descs():
            sizes = sorted({d.num_tokens for d in descriptors})
            what = f"capture {len(sizes)} target {mode.name} graphs"
            steps.append(Step("graphs", what, INDUCTOR if compiled else ""))
        return 0

    def registered_jit() -> None:
        kernels = runner.jit_warmup_registry._registrations
        for kernel, registrations in kernels.items():
            name = getattr(kernel, "name", type(kernel).__name__)
            what = f"JIT kernel {name} ({len(registrations)} registrations)"
            bases = " ".join(c.__name__ for c in type(kernel).__mro__)  # VllmTritonJitKernel, ...
            steps.append(Step("jit", what, needs_of(bases)))

    def real_kernel_warmup(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for name, function in vars(warmups).items():
                if (
                    inspect.isfunction(function)
                    and name != "kernel_warmup"
                    and ("warmup" in name or "autotune" in name)
                ):
                    patched = tripwire(name, function)
                    stack.enter_context(mock.patch.object(warmups, name, patched))
            for path in LOCAL_WARMUPS:  # recorded without importing their model packages
                module, name = path.rsplit(".", 1)
                stand_in = types.ModuleType(module)
                setattr(stand_in, name, recorder("jit", name, needs_of(name)))
                stack.enter_context(mock.patch.dict(sys.modules, {module: stand_in}))
            zeroer = getattr(runner, "_kv_block_zeroer", None)
            if zeroer is not None:
                record = recorder("jit", "KV block zeroing kernel", TRITON)
                stack.enter_context(mock.patch.object(zeroer, "warmup", record))
            registry = getattr(runner, "jit_warmup_registry", None)
            if registry is not None:
                stack.enter_context(mock.patch.object(registry, "warmup", registered_jit))
            warmups.kernel_warmup(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        for target, replacement in (
            (runner, {"_dummy_run": forward, "capture_model": capture}),
            (runner, {"_dummy_sampler_run": recorder("sampler", "sampler warm-up", "")}),
            (gpu_worker, {"kernel_warmup": real_kernel_warmup, "freeze_gc_heap": lambda: None}),
            (worker, {"_maybe_activate_jit_monitor": lambda: None}),
        ):
            for name, value in replacement.items():
                stack.enter_context(mock.patch.object(target, name, value))
        stack.enter_context(
            mock.patch(
                "vllm.compilation.compiler_interface.trigger_inductor_lazy_init",
                lambda device: None,
            )
        )
        super(type(worker), worker).compile_or_warm_up_model()  # vLLM's, not the dry one's
    return steps


def writable(directory: str) -> bool:
    """Whether `directory` is, or can be made, a directory this process writes into."""
    path = Path(directory)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def missing_needs(steps: list[Step], launched: set[str], environ=os.environ) -> Iterator[str]:
    """What the image on this node lacks for the compilers that must run: those of the JIT
    libraries the model launches (`launched`: kernels.Jit names) and of the recorded steps'
    Triton and Inductor work; and every JIT cache must be writable. One line each."""
    needs = {step.needs for step in steps}
    nvcc = find_nvcc()
    if "DeepGEMM" in launched and not nvcc and environ.get("DG_JIT_USE_NVRTC") != "1":
        yield "DeepGEMM compiles its kernels at first use and finds no nvcc (PATH, CUDA_HOME)"
    if (
        "FlashInfer" in launched
        and not nvcc
        and importlib.util.find_spec("flashinfer_cubin") is None
        and environ.get("HF_HUB_OFFLINE") == "1"
    ):
        yield (
            "FlashInfer has no nvcc to compile and no flashinfer-cubin: it downloads cubins at "
            "first use, and this node is offline (HF_HUB_OFFLINE=1)"
        )
    triton = "Triton" in launched or needs & {TRITON, INDUCTOR}
    if triton and not shutil.which(environ.get("CC") or "cc"):
        yield "Triton builds its kernel launchers with a host C compiler and finds no cc (or $CC)"
    for variable in CACHE_VARIABLES:
        if environ.get(variable) and not writable(environ[variable]):
            yield f"{variable}={environ[variable]} is not writable: JIT results cannot be cached"


class MissingNeeds(RuntimeError):
    """The image lacks what a warm-up, JIT or capture step needs."""

    fix = (
        "give the image what the step needs (docs/kernel-code.md, 'After the model is built'), "
        "or choose backends that need no compiler at start"
    )


def describe(report, steps: list[Step]) -> None:
    """One line per phase and need: what runs, in vLLM's order, and what it needs."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for step in steps:
        whats = grouped.setdefault((step.phase, step.needs), [])
        if step.what not in whats:
            whats.append(step.what)
    for (phase, needs), whats in grouped.items():
        report.decide(phase, "; ".join(whats), f"needs {needs}" if needs else "no compiler")
