# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Host vLLM's Model Runner V2 on a CPU, its Triton kernels under Triton's interpreter.

vLLM 0.33.0's CPU worker builds MRV2 (``vllm/v1/worker/cpu/model_runner.py``) and stubs CUDA
streams, events and pinned memory (``vllm/v1/worker/cpu/shm.py``); what it lacks on stock Triton
is answered here by five stand-ins, each applied as the vLLM module it answers is imported, so
vLLM's files stay as installed. Correctness only: the interpreter takes 0.1-0.25 s a step on
tiny models. ``install()`` must run before vLLM is imported, in the process that builds the
model runner: an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) is what ran here.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

ENV = {"TRITON_INTERPRET": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"}
"""The interpreter runs every ``@triton.jit`` kernel on the CPU; MRV2 is asked for by name."""


def _triton_cpu_backend_added(module: ModuleType, exec_module: Callable[[], None]) -> None:
    """``vllm/triton_utils/importing.py:37-48``: a ``+cpu`` vLLM sets ``HAS_TRITON = False``
    unless Triton has a "cpu" backend (the triton-cpu fork); stock Triton has none. A "cpu" entry
    is registered while the module runs and removed after: nothing compiles through it (its
    compiler and driver are Triton's abstract bases), and left registered it breaks Inductor's
    backend discovery."""
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    backends["cpu"] = Backend(compiler=BaseBackend, driver=DriverBase)
    try:
        exec_module()
    finally:
        del backends["cpu"]


def _torch_top_k_top_p(module: ModuleType, exec_module: Callable[[], None]) -> None:
    """``vllm/v1/sample/ops/topk_topp_sampler.py:515``: with Triton, ``apply_top_k_top_p`` takes
    ``topk_topp_triton.py``'s kernel, which the interpreter cannot run (line 128,
    ``row_id.to(tl.int64)`` on a Python int); vLLM's own torch path (line 520) serves instead."""
    exec_module()
    module.HAS_TRITON = False


class _TorchGrammarBitmask:
    """``vllm/v1/worker/gpu/structured_outputs.py:162-171``, in torch: the kernel's mask
    ``position_is_active & bitmask & ...`` mixes a scalar with a block, which the interpreter
    refuses. Called as the kernel is, ``kernel[grid](...)``, with the same arguments."""

    def __getitem__(self, grid: tuple[int, int]) -> Callable[..., None]:
        return self.apply

    @staticmethod
    def apply(
        logits: torch.Tensor,
        logits_stride: int,
        logits_indices: torch.Tensor,
        cu_num_logits: torch.Tensor,
        bitmask: torch.Tensor,
        bitmask_stride: int,
        vocab_size: int,
        MASK_STRIDE: int,
        BLOCK_SIZE: int,
    ) -> None:
        bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        for row, mapping in enumerate(logits_indices[: bitmask.shape[0]].tolist()):
            request, position = divmod(mapping, MASK_STRIDE)
            start, end = cu_num_logits[request : request + 2].tolist()
            if position >= end - start:
                continue
            allowed = (bitmask[row, :, None] >> bits) & 1
            banned = allowed.flatten()[:vocab_size] == 0
            logits[start + position].masked_fill_(banned, float("-inf"))


def _torch_grammar_bitmask(module: ModuleType, exec_module: Callable[[], None]) -> None:
    exec_module()
    module._apply_grammar_bitmask_kernel = _TorchGrammarBitmask()


def _torch_draft_logits_store(module: ModuleType, exec_module: Callable[[], None]) -> None:
    """``vllm/v1/worker/gpu/sample/gumbel.py:255-262``: a probabilistic draft has
    ``_gumbel_sample_kernel`` store its logits, masked by ``mask & is_valid_req``; the interpreter
    makes that block-and-scalar mask int32 and its store refuses it ("mask has unsupported
    dtype"). With a logits cache, ``gumbel_sample`` is called here as the kernel would compute:
    the store in torch, then vLLM's kernel without the cache, given per-token temperatures and
    the seeds ``spec_step_seed`` (line 267) would mix, so the sampled tokens are the kernel's."""
    exec_module()
    gumbel_sample = module.gumbel_sample

    def sample(
        logits: torch.Tensor,
        expanded_idx_mapping: torch.Tensor,
        temperature: torch.Tensor,
        seed: torch.Tensor,
        pos: torch.Tensor,
        apply_temperature: bool,
        is_drafting: bool,
        logits_cache: torch.Tensor | None = None,
        logits_cache_col: torch.Tensor | None = None,
        use_fp64: bool = False,
        logits_cache_source: torch.Tensor | None = None,
    ) -> torch.Tensor:
        args = (logits, expanded_idx_mapping, temperature, seed, pos, apply_temperature)
        if logits_cache is None or logits_cache_col is None:
            return gumbel_sample(
                *args, is_drafting, logits_cache, logits_cache_col, use_fp64, logits_cache_source
            )
        source = logits if logits_cache_source is None else logits_cache_source
        num_tokens, vocab_size = logits.shape
        assert source.shape == logits.shape and source.dtype == logits_cache.dtype
        assert logits_cache.size(-1) >= vocab_size
        req = expanded_idx_mapping.long()
        valid = req >= 0
        known = req.clamp(min=0)
        col = logits_cache_col.long().reshape(-1).expand(num_tokens)
        rows = valid.nonzero().squeeze(1)
        logits_cache[req[rows], col[rows], :vocab_size] = source[rows]
        token_temperature = torch.where(valid, temperature[known], 0)
        token_seed = torch.where(valid, seed[known], 0).long() ^ (col << 32)
        token = torch.arange(num_tokens, device=logits.device)
        mapping = torch.where(valid, token, -1).to(expanded_idx_mapping.dtype)
        return gumbel_sample(
            logits,
            mapping,
            token_temperature,
            token_seed,
            pos,
            apply_temperature,
            is_drafting,
            use_fp64=use_fp64,
        )

    module.gumbel_sample = sample


class _InterpretedLibdevice:
    """``vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py:946``: rejecting a
    probabilistic draft, ``_resample_kernel`` takes ``tldevice.log1p``, a libdevice extern the
    interpreter does not patch (it returns None); numpy's ``log1p`` on the interpreter's block."""

    @staticmethod
    def log1p(x: Any) -> Any:
        import numpy as np
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle

        with np.errstate(invalid="ignore", divide="ignore"):  # masked lanes, as on a GPU
            value = np.log1p(x.handle.data)
        return tl.tensor(TensorHandle(value, x.handle.dtype), x.type)


def _interpreted_log1p(module: ModuleType, exec_module: Callable[[], None]) -> None:
    exec_module()
    module.tldevice = _InterpretedLibdevice()


STAND_INS: dict[str, Callable[[ModuleType, Callable[[], None]], None]] = {
    "vllm.triton_utils.importing": _triton_cpu_backend_added,
    "vllm.v1.sample.ops.topk_topp_sampler": _torch_top_k_top_p,
    "vllm.v1.worker.gpu.structured_outputs": _torch_grammar_bitmask,
    "vllm.v1.worker.gpu.sample.gumbel": _torch_draft_logits_store,
    "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils": _interpreted_log1p,
}


class _StandInLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, stand_in: Callable[[ModuleType, Callable[[], None]], None]):
        self._loader = loader
        self._stand_in = stand_in

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._stand_in(module, lambda: self._loader.exec_module(module))


class _StandInFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of ``STAND_INS`` as the rest of ``sys.meta_path`` does, and runs each
    through its stand-in."""

    def find_spec(self, name: str, path: Any, target: Any = None):
        stand_in = STAND_INS.get(name)
        if stand_in is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _StandInLoader(spec.loader, stand_in)
        return spec


def install() -> None:
    """Set ``ENV`` and the stand-ins; refused once vLLM's Triton check has run, since its
    answer is then fixed for the process."""
    if "vllm.triton_utils.importing" in sys.modules:
        raise RuntimeError("cpu_mrv2.install() must run before vllm is imported")
    os.environ.update(ENV)
    if not any(isinstance(finder, _StandInFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _StandInFinder())
