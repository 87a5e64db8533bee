"""The torch stand-in for vLLM's CPU FP8 block-scaled linear (``quant_standins.py``): it computes
what a plain loop over the 128x128 blocks computes, a wrong scale layout or e8m0 bias is caught,
and vLLM's own kernel choice picks it only on a CPU without AMX tiles."""

import pytest
import torch

from tests.engine_v4 import quant_standins, quantise_v4
from tests.engine_v4.test_v4_quantised import weight


def loop_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() @ quantise_v4.dequantise_fp8_block(codes, scale).T).to(x.dtype)


def test_fp8_block_linear_equals_a_plain_loop_and_catches_wrong_scales():
    codes, scale = quantise_v4.quantise_fp8_block(weight(0))
    x = torch.randn(5, codes.shape[1], generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16)
    want = loop_linear(x, codes, scale)
    assert torch.equal(quant_standins.fp8_block_linear(x, codes, scale, [128, 128]), want)
    transposed = scale.view(torch.uint8).T.contiguous().view(3, 2).view(torch.float8_e8m0fnu)
    off_bias = (scale.view(torch.uint8) + 1).view(torch.float8_e8m0fnu)
    for wrong in (transposed, off_bias):
        assert not torch.equal(quant_standins.fp8_block_linear(x, codes, wrong, [128, 128]), want)


def choose_block_kernel():
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8Dynamic128Sym,
        kFp8Static128BlockSym,
    )

    config = linear.FP8ScaledMMLinearLayerConfig(
        weight_quant_key=kFp8Static128BlockSym,
        activation_quant_key=kFp8Dynamic128Sym,
        input_dtype=torch.bfloat16,
        out_dtype=torch.bfloat16,
        weight_shape=(256, 256),
    )
    return linear.choose_scaled_mm_linear_kernel(
        config=config,
        possible_kernels=linear._POSSIBLE_FP8_BLOCK_KERNELS,
        quantization="fp8_block_w8a8",
    )


@pytest.mark.parametrize("amx", [True, False])
def test_registered_only_where_vllm_has_no_kernel(monkeypatch, amx):
    from vllm.model_executor.kernels import linear
    from vllm.platforms import PlatformEnum

    kernels = list(linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU])
    monkeypatch.setitem(linear._POSSIBLE_FP8_BLOCK_KERNELS, PlatformEnum.CPU, kernels)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    installed = quant_standins.install_quant_standins()
    assert installed == ([] if amx else ["TorchFp8BlockScaledMMKernel"])
    if amx:
        assert choose_block_kernel() is not quant_standins.TorchFp8BlockScaledMMKernel
    else:
        assert choose_block_kernel() is quant_standins.TorchFp8BlockScaledMMKernel


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="vLLM's kernel needs AMX")
def test_fp8_block_linear_matches_vllms_amx_kernel():
    """Against vLLM's own ``fp8_scaled_mm_cpu`` (W8A16, unpacked weight): equal up to bf16
    rounding of the fp32 sums; with transposed block scales far apart."""
    from vllm import _custom_ops  # noqa: F401  (loads vLLM's CPU ops)
    from vllm.model_executor.layers.quantization.utils.fp8_utils import _upcast_e8m0_to_fp32

    codes, scale = quantise_v4.quantise_fp8_block(weight(0))
    codes = torch.cat([codes, codes[:40]])  # 384 rows: the AMX kernel tiles N by 32
    x = torch.randn(5, codes.shape[1], generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16)
    amx = torch.ops._C.fp8_scaled_mm_cpu(
        x, codes, _upcast_e8m0_to_fp32(scale).contiguous(), [128, 128], None, x.dtype, False
    )

    def error(scale):
        ours = quant_standins.fp8_block_linear(x, codes, scale, [128, 128]).float()
        return ((ours - amx.float()).norm() / amx.float().norm()).item()

    transposed = scale.view(torch.uint8).T.contiguous().view(3, 2).view(torch.float8_e8m0fnu)
    print(f"relative difference from vLLM's AMX kernel: {error(scale):.2e}")
    assert error(scale) < 1e-4
    assert error(transposed) > 0.1
