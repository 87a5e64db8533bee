"""Torch stand-in for vLLM's CPU FP8 block-scaled linear where the CPU has no AMX tiles.

vLLM 0.32.0 lists ``CPUFp8W8A8BlockScaledMMKernel`` and ``CPUFp8BlockScaledMMKernel`` for block-FP8
linears on CPU (``_POSSIBLE_FP8_BLOCK_KERNELS``); both refuse in ``is_supported`` without AMX
(``torch.cpu._is_amx_tile_supported()``), so kernel choice fails there. The stand-in is appended
to that list and supports exactly those hosts: it dequantises the weight with vLLM's own helper
(``_dequant_linear_weight``, what vLLM's CPU DeepSeek-V4 attention applies to ``wo_a``) and runs
a torch matmul. ``test_quant_standins.py`` checks it against a plain loop over the blocks.
"""

from __future__ import annotations

import types

import torch
from typing_extensions import override

from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel


def fp8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: list[int]
) -> torch.Tensor:
    """``x @ (weight * its block's scale).T`` in fp32, returned in ``x``'s dtype."""
    from vllm.models.deepseek_v4.cpu.cpu_sparse import _dequant_linear_weight

    layer = types.SimpleNamespace(weight=weight, weight_scale_inv=scale, weight_block_size=block)
    return (x.float() @ _dequant_linear_weight(layer).T).to(x.dtype)


class TorchFp8BlockScaledMMKernel(CPUFp8BlockScaledMMKernel):
    """W8A16 block-FP8 linear by dequantisation and torch matmul, on CPUs without AMX only."""

    @override
    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False, "requires CPU platform."
        if torch.cpu._is_amx_tile_supported():
            return False, "vLLM's own CPU kernels serve AMX hosts."
        return True, None

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


def install_quant_standins() -> list[str]:
    """Register the stand-in where vLLM has no block-FP8 CPU kernel; returns what was installed."""
    from vllm.model_executor.kernels import linear
    from vllm.platforms import PlatformEnum

    kernels = linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]
    if torch.cpu._is_amx_tile_supported() or TorchFp8BlockScaledMMKernel in kernels:
        return []
    kernels.append(TorchFp8BlockScaledMMKernel)
    return ["TorchFp8BlockScaledMMKernel"]
