# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The torch stand-ins for vLLM's CPU FP8 block-scaled linear and MXFP4 MoE (``quant_standins.py``):
each computes what a plain loop computes, a wrong scale layout, e8m0 bias or nibble order is
caught, and vLLM's own kernel choice picks them only on a CPU without AMX tiles."""

import pytest
import torch
from packaging.version import Version

import vllm
from dspark_fixtures import quant_standins
from dspark_fixtures.checkpoints import deepseek_v4_quantised as quantise_v4
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
def test_registered_only_where_vllm_has_no_kernel(monkeypatch, amx, moe_config):
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsMxfp4
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
        select_deepseek_v4_mxfp4_moe_backend as oracle_select,
    )
    from vllm.model_executor.layers.quantization import mxfp4
    from vllm.platforms import PlatformEnum

    # vLLM's own choices, whatever an earlier test in this process installed
    kernels = [
        kernel
        for kernel in linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]
        if kernel is not quant_standins.TorchFp8BlockScaledMMKernel
    ]
    monkeypatch.setitem(linear._POSSIBLE_FP8_BLOCK_KERNELS, PlatformEnum.CPU, kernels)
    monkeypatch.setattr(mxfp4, "select_deepseek_v4_mxfp4_moe_backend", oracle_select)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    installed = quant_standins.install_quant_standins()
    assert installed == ([] if amx else ["TorchFp8BlockScaledMMKernel", "TorchMxfp4Experts"])
    chosen = mxfp4.select_deepseek_v4_mxfp4_moe_backend(moe_config)
    if amx and not hasattr(torch.ops._C, "fp8_scaled_mm_cpu"):
        # AMX reported on an AVX2-only CPU, whose extension has no AMX kernel: vLLM finds no
        # FP8 block kernel, and no stand-in covers for it.
        with pytest.raises(ValueError, match="fp8_scaled_mm_cpu op not available"):
            choose_block_kernel()
        assert chosen == (Mxfp4MoeBackend.CPU, CPUExpertsMxfp4)
    elif amx:
        assert choose_block_kernel() is not quant_standins.TorchFp8BlockScaledMMKernel
        assert chosen == (Mxfp4MoeBackend.CPU, CPUExpertsMxfp4)
    else:
        assert choose_block_kernel() is quant_standins.TorchFp8BlockScaledMMKernel
        assert chosen == (Mxfp4MoeBackend.EMULATION, quant_standins.TorchMxfp4Experts)
        with pytest.raises(NotImplementedError, match="No MXFP4 MoE backend supports"):
            oracle_select(moe_config)


@pytest.fixture(scope="module")
def moe_config(tmp_path_factory):
    """The FusedMoEConfig of the quantised draft's stage-0 experts (built with the stand-ins, AMX
    reported off). Built on cpu, not meta: vLLM caches rotary embeddings by their arguments
    (``get_rope``'s ``_ROPE_DICT``), and a meta one broke the next V4 engine of the session."""
    from dspark_fixtures.checkpoints import deepseek_v4 as tiny_v4
    from dspark_fixtures.v4_draft import build_draft, v4_vllm_config

    config = quantise_v4.QUANTISED_V4_CONFIG
    shipped = quantise_v4.quantise_v4_checkpoint(tiny_v4.random_v4_checkpoint(config))[0]
    model_dir = tiny_v4.save_v4_target(
        tmp_path_factory.mktemp("moe-config"), shipped, config, keep_dtypes=True
    )
    with quant_standins.amx_reported_off():
        model = build_draft(v4_vllm_config(model_dir))
    return model.backbone.layers[0].ffn.experts.routed_experts.moe_config


def test_vllms_emulation_backend_cannot_serve_this_cpu(monkeypatch, moe_config):
    """vLLM 0.32.0's own MXFP4 ``emulation`` backend, asked for by name: refused for want of
    ``amd-quark``, and with it reported present, because its Triton experts run on CUDA and XPU
    only (Triton has no CPU backend here either)."""
    import dataclasses

    from vllm.model_executor.layers.fused_moe.experts import ocp_mx_emulation_moe
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
        select_deepseek_v4_mxfp4_moe_backend,
    )

    asked = dataclasses.replace(moe_config, moe_backend="emulation")
    with pytest.raises(ValueError, match="kernel requires amd-quark package"):
        select_deepseek_v4_mxfp4_moe_backend(asked)
    monkeypatch.setattr(ocp_mx_emulation_moe, "has_quark", lambda: True)
    with pytest.raises(ValueError, match="kernel does not support current device cpu"):
        select_deepseek_v4_mxfp4_moe_backend(asked)


# --- MXFP4 MoE --------------------------------------------------------------------------------

EXPERTS, HIDDEN, INTER, TOPK, LIMIT = 4, 128, 128, 2, 10.0


def expert_weights(seed: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``EXPERTS`` MXFP4 weights ``[rows, cols]`` stacked: (uint8 codes, uint8 e8m0 scales)."""
    pairs = [quantise_v4.quantise_mxfp4(weight(seed + e, (rows, cols))) for e in range(EXPERTS)]
    return (
        torch.stack([p for p, _ in pairs]).view(torch.uint8),
        torch.stack([s for _, s in pairs]).view(torch.uint8),
    )


def moe_case():
    w13, w13_scale = expert_weights(10, 2 * INTER, HIDDEN)
    w2, w2_scale = expert_weights(20, HIDDEN, INTER)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, HIDDEN, generator=g) * 0.3).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(6)])
    weights = torch.rand(6, TOPK, generator=g)
    return x, (w13, w13_scale, w2, w2_scale), weights, ids.to(torch.int32)


def loop_moe(x, w13, w13_scale, w2, w2_scale, weights, ids, limit):
    """Per token and chosen expert, decoded by the plain loop of ``quantise_v4``."""
    up13 = [quantise_v4.dequantise_mxfp4(w13[e], w13_scale[e]) for e in range(EXPERTS)]
    down = [quantise_v4.dequantise_mxfp4(w2[e], w2_scale[e]) for e in range(EXPERTS)]
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for k in range(TOPK):
            e = int(ids[t, k])
            gate, up = (up13[e] @ x[t].float()).chunk(2)
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            out[t] += weights[t, k] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out.to(x.dtype)


def standin_moe(x, w13, w13_scale, w2, w2_scale, weights, ids, limit=LIMIT):
    values13 = quant_standins.mxfp4_values(w13, w13_scale)
    values2 = quant_standins.mxfp4_values(w2, w2_scale)
    return quant_standins.mxfp4_moe(x, values13, values2, weights, ids, limit)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_mxfp4_values_are_vllms_decode_and_a_plain_loops():
    from vllm.model_executor.layers.fused_moe.flashinfer_moe_ep import (
        _dequant_mxfp4_ue8m0_gran32,
    )

    w13, w13_scale = expert_weights(10, 2 * INTER, HIDDEN)
    values = quant_standins.mxfp4_values(w13, w13_scale)
    for e in range(EXPERTS):
        assert torch.equal(values[e], _dequant_mxfp4_ue8m0_gran32(w13[e], w13_scale[e]).float())
        assert torch.equal(values[e], quantise_v4.dequantise_mxfp4(w13[e], w13_scale[e]))


def test_mxfp4_moe_equals_a_plain_loop_and_catches_wrong_variants():
    """Equal up to fp32 summation order (then bf16); the clamp is active on this case. Caught: an
    e8m0 bias off by one, scales read along the wrong axis, nibbles swapped, gate and up rows
    swapped, no clamp."""
    x, (w13, w13_scale, w2, w2_scale), weights, ids = moe_case()
    want = loop_moe(x, w13, w13_scale, w2, w2_scale, weights, ids, LIMIT)
    error = relative(standin_moe(x, w13, w13_scale, w2, w2_scale, weights, ids), want)
    print(f"MXFP4 MoE stand-in vs plain loop: relative difference {error:.2e}")
    assert error < 1e-2
    assert relative(loop_moe(x, w13, w13_scale, w2, w2_scale, weights, ids, None), want) > 0.05
    off_bias = w13_scale + 1, w2_scale + 1
    wrong_axis = tuple(s.transpose(1, 2).contiguous().view(s.shape) for s in (w13_scale, w2_scale))
    swapped = tuple((w >> 4) | (w << 4) for w in (w13, w2))
    gate_up = torch.cat([w13[:, INTER:], w13[:, :INTER]], 1)
    gate_up_scale = torch.cat([w13_scale[:, INTER:], w13_scale[:, :INTER]], 1)
    wrong = {
        "e8m0 bias": standin_moe(x, w13, off_bias[0], w2, off_bias[1], weights, ids),
        "scale axis": standin_moe(x, w13, wrong_axis[0], w2, wrong_axis[1], weights, ids),
        "nibbles": standin_moe(x, swapped[0], w13_scale, swapped[1], w2_scale, weights, ids),
        "gate/up": standin_moe(x, gate_up, gate_up_scale, w2, w2_scale, weights, ids),
        "no clamp": standin_moe(x, w13, w13_scale, w2, w2_scale, weights, ids, None),
    }
    for name, out in wrong.items():
        assert relative(out, want) > 0.05, name


@pytest.mark.each_vllm
def test_vllms_amx_moe_kernel_is_callable_except_under_vllm_0_33_0():
    """The reason the AMX-kernel tests skip under .venv's vLLM 0.33.0, and only there (or on an
    AVX2-only CPU, whose extension has no AMX kernel)."""
    reason = quant_standins.amx_moe_kernel_mismatch()
    if not hasattr(torch.ops._C, "fused_experts_cpu"):
        assert reason == quant_standins.NO_AMX_KERNELS
    else:
        assert (reason is not None) == (Version(vllm.__version__).release[:2] == (0, 33)), reason


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="vLLM's kernel needs AMX")
def test_mxfp4_moe_matches_vllms_amx_kernel():
    """Against vLLM's own ``CPUExpertsMxfp4`` kernel (``fused_experts_cpu``, MXFP4, limit 10):
    equal up to bf16 rounding where the clamp is inactive; where it is active, the kernel equals
    the unclamped stand-in (it leaves V4's clamp out for SiLU). Scales along the wrong axis are
    far apart."""
    from vllm._custom_ops import CPUQuantMethod, fused_experts_cpu

    if reason := quant_standins.amx_moe_kernel_mismatch():
        pytest.skip(reason)
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
        prepare_mxfp4_moe_layer_for_cpu,
    )

    x, (w13, w13_scale, w2, w2_scale), weights, ids = moe_case()
    packed = prepare_mxfp4_moe_layer_for_cpu(w13, w2, w13_scale, w2_scale)

    def amx(x):
        out = torch.empty_like(x)
        fused_experts_cpu(
            out, x, packed[0], packed[1], weights, ids, CPUQuantMethod.MXFP4, packed[2],
            packed[3], None, None, None, None, None, None, LIMIT, True,
        )  # fmt: skip
        return out

    small = (x.float() * 0.01).to(x.dtype)  # every SwiGLU input below the limit
    error = relative(standin_moe(small, w13, w13_scale, w2, w2_scale, weights, ids), amx(small))
    unclamped = relative(standin_moe(x, w13, w13_scale, w2, w2_scale, weights, ids, None), amx(x))
    print(f"MXFP4 MoE stand-in vs vLLM's AMX kernel: {error:.2e}; clamp active: {unclamped:.2e}")
    assert error < 1e-2 and unclamped < 1e-2
    assert relative(standin_moe(x, w13, w13_scale, w2, w2_scale, weights, ids), amx(x)) > 0.05
    wrong = tuple(s.transpose(1, 2).contiguous().view(s.shape) for s in (w13_scale, w2_scale))
    assert (
        relative(standin_moe(small, w13, wrong[0], w2, wrong[1], weights, ids), amx(small)) > 0.05
    )
