# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The tiny V4 checkpoint quantised as DeepSeek-V4-Flash ships, and its dequantised bf16 twin.

V4-Flash's ``quantization_config`` (``fp8``, ``e4m3``, ``ue8m0`` scales, 128x128 blocks) and
``expert_dtype: fp4``:
- every attention, shared-expert and ``main_proj`` linear ``X.weight`` is ``float8_e4m3fn`` with
  ``X.scale`` ``float8_e8m0fnu`` ``[ceil(out / 128), ceil(in / 128)]``, one power of two per
  128x128 block (row blocks first);
- every routed expert ``ffn.experts.{e}.w{1,2,3}.weight`` is MXFP4: two e2m1 codes per ``int8``
  byte (element 2i in the low nibble) ``[out, in / 2]``, with ``.scale`` ``float8_e8m0fnu``
  ``[out, in / 32]``, one power of two per 32 inputs;
- the mHC tensors, ``attn_sink`` and the router bias are fp32; embeddings, the head, the router
  gate, norms and the Markov and confidence heads bf16.

The twin holds exactly the values the quantised tensors stand for (codes times scales), in bf16,
under the same names without ``.scale``; its config has no ``quantization_config``.
"""

import re

import torch
from torch import Tensor

from dspark_fixtures.checkpoints import deepseek_v4
from dspark_fixtures.checkpoints.deepseek_v4 import TINY_V4_CONFIG
from dspark_fixtures.deepseek_v4_flash import FP8_BLOCK, MXFP4_GROUP, V4_FLASH_CONFIG

FP8_MAX = 448.0
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E8M0_BIAS = 127
_FP8_LINEAR = re.compile(
    r"(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123]|main_proj)"
    r"\.weight"
)
_FP32 = re.compile(r"hc_(attn|ffn|head)_(fn|base|scale)$|attn_sink$|ffn\.gate\.bias$")
_EXPERT = re.compile(r"(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")

# The tiny V4 config with every dimension an FP8 linear splits into output shards a multiple of
# the 128-row block (vLLM's block-FP8 layers refuse partial blocks in a shard), as V4-Flash's are.
QUANTISED_V4_CONFIG: dict = {
    **TINY_V4_CONFIG,
    "hidden_size": 128,
    "q_lora_rank": 128,
    "o_lora_rank": 128,
    "moe_intermediate_size": 128,
    "expert_dtype": "fp4",
    "quantization_config": V4_FLASH_CONFIG["quantization_config"],
}


def e8m0(exponent: Tensor) -> Tensor:
    """Power-of-two scales 2**exponent as ``float8_e8m0fnu`` (biased exponent bytes)."""
    return (exponent + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def quantise_fp8_block(weight: Tensor) -> tuple[Tensor, Tensor]:
    """``[out, in]`` -> (e4m3 weight, e8m0 scale per 128x128 block, row blocks first)."""
    out_features, in_features = weight.shape
    rows, cols = -(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK)
    padded = weight.new_zeros(rows * FP8_BLOCK, cols * FP8_BLOCK)
    padded[:out_features, :in_features] = weight
    blocks = padded.view(rows, FP8_BLOCK, cols, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-30)
    exponent = torch.ceil(torch.log2(amax / FP8_MAX))
    scale = torch.exp2(exponent)[:, None, :, None]
    codes = (blocks / scale).to(torch.float8_e4m3fn).view(rows * FP8_BLOCK, cols * FP8_BLOCK)
    return codes[:out_features, :in_features].contiguous(), e8m0(exponent)


def quantise_mxfp4(weight: Tensor) -> tuple[Tensor, Tensor]:
    """``[out, in]`` -> (int8 packed e2m1 codes ``[out, in/2]``, e8m0 scale ``[out, in/32]``)."""
    out_features, in_features = weight.shape
    groups = weight.view(out_features, in_features // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(dim=-1).clamp(min=1e-30)
    exponent = torch.floor(torch.log2(amax)) - 2  # e2m1's largest exponent is 2 (6 = 1.5 * 4)
    scaled = (groups / torch.exp2(exponent)[..., None]).clamp(-6.0, 6.0)
    # The nearest e2m1 value, a tie to the smaller one: the midpoints between the sorted values.
    index = torch.bucketize(scaled.abs(), (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2)
    codes = (index | ((scaled < 0).long() << 3)).view(out_features, in_features).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), e8m0(exponent)


def dequantise_fp8_block(codes: Tensor, scale: Tensor) -> Tensor:
    """A plain loop over the 128x128 blocks: code times its block's power of two."""
    out = codes.float()
    exponents = scale.view(torch.uint8).long() - E8M0_BIAS
    for r in range(exponents.shape[0]):
        for c in range(exponents.shape[1]):
            rows = slice(r * FP8_BLOCK, (r + 1) * FP8_BLOCK)
            cols = slice(c * FP8_BLOCK, (c + 1) * FP8_BLOCK)
            out[rows, cols] *= 2.0 ** exponents[r, c].item()
    return out


def dequantise_mxfp4(packed: Tensor, scale: Tensor) -> Tensor:
    """A plain loop over the packed bytes: two e2m1 codes, each times its group's power of two."""
    raw = packed.view(torch.uint8)
    exponents = scale.view(torch.uint8).long() - E8M0_BIAS
    out = torch.empty(raw.shape[0], raw.shape[1] * 2)
    for i in range(raw.shape[0]):
        for j in range(raw.shape[1]):
            for half, code in enumerate((raw[i, j].item() & 0xF, raw[i, j].item() >> 4)):
                k = 2 * j + half
                value = E2M1_VALUES[code & 7].item() * (-1.0 if code & 8 else 1.0)
                out[i, k] = value * 2.0 ** exponents[i, k // MXFP4_GROUP].item()
    return out


def quantise_v4_checkpoint(
    checkpoint: dict[str, Tensor],
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(the checkpoint as V4-Flash ships it, its dequantised bf16 twin)."""
    shipped, twin = {}, {}
    for name, tensor in checkpoint.items():
        stem = name.removesuffix(".weight")
        if _FP8_LINEAR.fullmatch(name) or _EXPERT.fullmatch(name):
            quantise = quantise_fp8_block if _FP8_LINEAR.fullmatch(name) else quantise_mxfp4
            codes, scale = quantise(tensor.float())
            shipped[name], shipped[stem + ".scale"] = codes, scale
            dequantised = (
                _fp8_block_values(codes, scale)
                if codes.dtype == torch.float8_e4m3fn
                else _mxfp4_values(codes, scale)
            )
            twin[name] = dequantised.to(torch.bfloat16)
        else:
            dtype = torch.float32 if _FP32.search(name) else torch.bfloat16
            shipped[name] = twin[name] = tensor.to(dtype)
    return shipped, twin


def _fp8_block_values(codes: Tensor, scale: Tensor) -> Tensor:
    exponents = scale.view(torch.uint8).float() - E8M0_BIAS
    factor = torch.exp2(exponents).repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return codes.float() * factor[: codes.shape[0], : codes.shape[1]]


def _mxfp4_values(packed: Tensor, scale: Tensor) -> Tensor:
    raw = packed.view(torch.uint8).long()
    codes = torch.stack([raw & 0xF, raw >> 4], dim=-1).flatten(1)
    signed = torch.cat([E2M1_VALUES, -E2M1_VALUES])
    exponents = scale.view(torch.uint8).float() - E8M0_BIAS
    values = signed.index_select(0, codes.flatten()).view(codes.shape)
    return values * torch.exp2(exponents).repeat_interleave(MXFP4_GROUP, dim=1)


# The draft's routed experts in the oracle checkpoint add nothing (its ``w2`` is zero). With
# these gains they add about an eighth of the residual they are added to, and the SwiGLU inputs
# stay far below V4's ``swiglu_limit`` of 10 (vLLM's CPU bf16 MoE, which the twin runs, does not
# clamp; its MXFP4 MoE does).
MOE_W2_GAIN = 20.0
MOE_W13_GAIN = 0.5


def moe_oracle_checkpoint(config: dict = QUANTISED_V4_CONFIG) -> dict[str, Tensor]:
    """The context-dependent oracle (``target_noise`` 0.3) whose draft's routed experts contribute:
    the random checkpoint's expert weights, ``w2`` times ``MOE_W2_GAIN``, ``w1``/``w3`` times
    ``MOE_W13_GAIN``."""
    checkpoint = deepseek_v4.oracle_v4_checkpoint(config, target_noise=0.3)
    random = deepseek_v4.random_v4_checkpoint(config)
    for name in checkpoint:
        if name.startswith("mtp.") and _EXPERT.fullmatch(name):
            gain = MOE_W2_GAIN if name.endswith("w2.weight") else MOE_W13_GAIN
            checkpoint[name] = random[name] * gain
    return checkpoint
