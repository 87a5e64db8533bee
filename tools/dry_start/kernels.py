# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Whether the image carries GPU code for every kernel library the chosen backends launch.

The libraries are read from the objects vLLM built: each attention layer's backend (and, for
FlashAttention, the version its implementation chose), each quantisation method's linear kernel
and MoE experts, and vLLM's custom operators. A library compiled into the wheel is looked up in
the fat binaries of its shared object (`tools/fatbin.py`): on a host without the device, in the
wheel the image installs for the device's architecture (the Dockerfile whose `GPU_TARGETS`
names it: aarch64 for DGX Spark, x86_64 for Blackwell); on the node, in the installed files.
Each gets "native", "JIT from PTX at first use" (with the PTX the driver compiles) or "no code:
will fail", which stops the start. A library that compiles its kernels at run time (Triton,
DeepGEMM, FlashInfer, CuTe DSL, TileLang) is listed with what that needs (`warmup.py`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from tools import fatbin
from tools.dry_start.engine import CHOICE_ATTRIBUTES, _name

REPO = Path(__file__).resolve().parents[2]
# ptxas 13.0 on the shared 2-core CI box (load average about 8), compiling FlashAttention 2's
# compute_80 PTX for sm_120: 10.9 MiB in 181 s (docs/kernel-code.md). The driver's JIT is the
# same compiler; a faster, idle host takes less.
PTXAS_SECONDS_PER_MIB = 16.6
MACHINES = {"linux/arm64": "aarch64", "linux/amd64": "x86_64"}


@dataclass(frozen=True)
class Library:
    """Kernels compiled into one of the wheel's shared objects, found by its path's pattern."""

    name: str
    member: str

    def find(self, listing: dict[str, dict]) -> str | None:
        return next((m for m in sorted(listing) if re.fullmatch(self.member, m)), None)


@dataclass(frozen=True)
class Jit:
    """Kernels compiled on the node at first use (or at warm-up)."""

    name: str
    needs: str


CORE = Library("vLLM _C", r"vllm/_C(_\w+)?\.abi3\.so")
MOE = Library("vLLM _moe_C", r"vllm/_moe_C(_\w+)?\.abi3\.so")
FLASH_ATTN: dict[int, Library | Jit] = {
    2: Library("FlashAttention 2", r"vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so"),
    3: Library("FlashAttention 3", r"vllm/vllm_flash_attn/_vllm_fa3_C\.abi3\.so"),
    4: Jit("FlashAttention 4 (CuTe DSL)", "CuTe DSL compiles it in-process (CUTE_DSL_CACHE_DIR)"),
}
FLASHMLA = Library("FlashMLA", r"vllm/_flashmla_C\.abi3\.so")
TRITON = Jit(
    "Triton",
    "Triton compiles with its bundled ptxas and builds its launcher with the host C compiler "
    "(TRITON_CACHE_DIR)",
)
DEEP_GEMM = Jit(
    "DeepGEMM",
    "DeepGEMM compiles with NVCC from CUDA_HOME, or NVRTC with DG_JIT_USE_NVRTC=1 "
    "(DG_JIT_CACHE_DIR); the wheel's deep_gemm extension carries no GPU code",
)
FLASHINFER = Jit(
    "FlashInfer",
    "flashinfer-python ships no GPU code: its kernels are JIT-compiled with nvcc "
    "(FLASHINFER_WORKSPACE_BASE) or loaded as cubins from flashinfer-cubin, else downloaded",
)
CUTE_DSL = Jit("CuTe DSL", "CuTe DSL compiles in-process (CUTE_DSL_CACHE_DIR)")

# Words in a kernel class's module or name -> where its code is, first match wins.
KERNEL_WORDS: tuple[tuple[str, Library | Jit], ...] = (
    ("deep_gemm", DEEP_GEMM),
    ("deepgemm", DEEP_GEMM),
    ("flashinfer", FLASHINFER),
    ("trtllm", FLASHINFER),
    ("cute", CUTE_DSL),
    ("triton", TRITON),
    ("marlin", MOE),
    ("cutlass", CORE),
)
# vLLM's attention backend names -> where their code is (FlashAttention by its version).
BACKEND_WORDS: tuple[tuple[str, Library | Jit], ...] = (
    ("FLASHINFER", FLASHINFER),
    ("TRITON", TRITON),
    ("FLASHMLA", FLASHMLA),
    ("CUTLASS_MLA", CORE),
)
NATIVE = "native"
PTX_JIT = "JIT from PTX at first use"
NO_CODE = "no code: will fail"


class NoKernelCode(ValueError):
    """A library a chosen backend launches carries no code for the device."""

    fix = (
        "choose a backend whose library carries code for this GPU (--attention-backend, "
        "--moe-backend, the quantisation's kernel), or an image built for it"
    )


@dataclass(frozen=True)
class KernelCode:
    """The fat binaries of the vLLM the node runs: where they were read, and each `.so`'s
    `Listing.as_json()`."""

    source: str
    listing: dict[str, dict]


def image_wheel(capability: tuple[int, int], version: str, wheels: Path) -> KernelCode | str:
    """The listing of the vLLM wheel the image for `capability` installs, or why it is not
    read: the Dockerfile whose GPU_TARGETS names the architecture gives the platform."""
    arch = f"sm_{capability[0]}{capability[1]}"
    for dockerfile in sorted((REPO / "docker").glob("*.Dockerfile")):
        text = dockerfile.read_text()
        targets = re.search(r'^ARG GPU_TARGETS="([^"]*)"', text, re.MULTILINE)
        platform = re.search(r"^ARG BASE_PLATFORM=(\S+)", text, re.MULTILINE)
        if targets and platform and arch in targets[1].split():
            machine = MACHINES[platform[1]]
            found = sorted(wheels.glob(f"vllm-{version}-*_{machine}.whl"))
            if not found:
                return (
                    f"the {machine} vLLM {version} wheel that {dockerfile.name} installs is not in "
                    f"{wheels} (scripts/setup-cpu-env.sh fetches it)"
                )
            listing = fatbin.wheel_listing(found[0])
            return KernelCode(f"{found[0].name} ({dockerfile.name})", listing)
    return f"no Dockerfile in docker/ lists {arch} in GPU_TARGETS"


def installed() -> KernelCode:
    """The installed vLLM's shared objects, as its RECORD names them (on the node)."""
    for name in metadata.packages_distributions().get("vllm", []):
        dist = metadata.distribution(name)
        files = [str(f) for f in dist.files or [] if str(f).endswith(".so")]
        if files:
            listing = {
                path: fatbin.read(Path(str(dist.locate_file(path))).read_bytes()).as_json()
                for path in files
            }
            return KernelCode(f"{name} {dist.version} as installed", listing)
    return KernelCode("no vLLM shared objects installed", {})


def by_words(text: str, table) -> Library | Jit | None:
    text = text.lower()
    return next((source for word, source in table if word.lower() in text), None)


def launched(config, runner) -> Iterator[tuple[str, Library | Jit | None]]:
    """(what launches it, where its code is) for every kernel library the built model uses;
    None where this module does not know the library."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(config, AttentionLayerBase)  # type: ignore[type-abstract]
    for layer in layers.values():
        backend = layer.get_attn_backend().get_name()
        version = getattr(getattr(layer, "impl", None), "vllm_flash_attn_version", None)
        if backend.startswith("FLASH_ATTN") and version in FLASH_ATTN:
            yield f"attention {backend} (FA{version})", FLASH_ATTN[version]
        else:
            yield f"attention {backend}", by_words(backend, BACKEND_WORDS)
    moe = False
    for model in (runner.get_model(), getattr(getattr(runner, "drafter", None), "model", None)):
        for module in model.modules() if model is not None else ():
            method = getattr(module, "quant_method", None)
            moe = moe or "moe" in type(method).__name__.lower()
            for attribute in CHOICE_ATTRIBUTES:
                chosen = getattr(method, attribute, None)
                if chosen is not None:
                    where = f"{getattr(chosen, '__module__', '')}.{_name(chosen)}"
                    yield f"{attribute} {_name(chosen)}", by_words(where, KERNEL_WORDS)
    yield "custom ops (norms, rotary, activations, cache writes)", CORE
    if moe:
        yield "MoE routing and alignment ops", MOE


def library_verdict(library: Library, code: KernelCode, device: tuple[int, int]) -> tuple[str, str]:
    """(verdict, detail) for one compiled library on `device`."""
    member = library.find(code.listing)
    if member is None:
        return NO_CODE, f"{library.name}: no {library.member} in {code.source}"
    entry = code.listing[member]
    counts = fatbin.coverage(entry, device)
    jit_mib = (
        sum(
            v["ptx_bytes"]
            for v in entry["by_fatbin"]
            if fatbin.arch_verdict(v["sass"], v["ptx"], device) == fatbin.PTX_JIT
        )
        / 2**20
    )
    modules = sum(counts.values())
    others = f"; {counts[fatbin.NONE]} hold code for other GPUs only" if counts[fatbin.NONE] else ""
    each = jit_mib / max(counts[fatbin.PTX_JIT], 1) * PTXAS_SECONDS_PER_MIB / 60
    jit = (
        f"{counts[fatbin.PTX_JIT]} JIT-compiled from PTX when first used ({jit_mib:.1f} MiB of "
        f"PTX: about {each:.1f} min of ptxas per module at the rate in docs/kernel-code.md, "
        "then cached in CUDA_CACHE_PATH)"
    )
    where = f"{member}: {modules} modules"
    if counts[fatbin.NATIVE]:
        detail = f"{where}, {counts[fatbin.NATIVE]} native" + (
            f", {jit}" if counts[fatbin.PTX_JIT] else ""
        )
        return NATIVE, detail + others
    if counts[fatbin.PTX_JIT]:
        return PTX_JIT, f"{where}, {jit}{others}"
    sass = " ".join(entry["sass"]) or "none"
    return NO_CODE, f"{where}, machine code for {sass} only and no PTX that compiles for it"


def describe_kernels(
    report, uses: list[tuple[str, Library | Jit | None]], device: tuple[int, int], code
) -> None:
    """One line per (what launches it, library) in `uses` (`launched`): the verdict on `device`
    from `code` (a KernelCode, or why none was read); raise NoKernelCode for a library that
    carries nothing the device runs."""
    if isinstance(code, str):
        report.warnings.append(f"kernel code not read: {code}")
        return
    report.decide("kernels", "read from", code.source)
    missing = []
    for (what, source), count in Counter(uses).items():
        label = f"{what} x{count}" if count > 1 else what
        if source is None:
            report.decide("kernels", label, "library not known to the dry start: not checked")
        elif isinstance(source, Jit):
            report.decide("kernels", label, f"{source.name}: compiled on the node: {source.needs}")
        else:
            verdict, detail = library_verdict(source, code, device)
            report.decide("kernels", label, f"{verdict}: {detail}")
            if verdict == NO_CODE:
                missing.append(f"{label} ({detail})")
    if missing:
        raise NoKernelCode(
            f"no GPU code for sm_{device[0]}{device[1]} in the image for " + "; ".join(missing)
        )
