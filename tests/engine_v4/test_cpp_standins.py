# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Each DeepSeek-V4 C++ stand-in against the real op (where this host's extension has it) and
against a plain per-token loop written from the kernel's semantics (everywhere), with a
deliberately wrong variant of each that the loop comparison must catch.

Tolerances: where the stand-in does the kernel's arithmetic in the same fp32 order the outputs
are equal (the fp8 cache bytes, the top-k ids, the packed-weight product rounded to bf16 agree
exactly here; the fp32 outputs to 1e-5). bf16 outputs may differ by one bf16 rounding step
(relative 2**-8) where the kernel accumulates in another order or rounds an intermediate:
``flash_mla_with_kvcache_cpu`` rounds its unnormalized probabilities to bf16 before P @ V, so its
outputs (|o| < 4 here) get an absolute 2e-2 on top of bf16's relative 1.6e-2.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from dspark_fixtures import cpp_standins as cs

BF16 = dict(rtol=1.6e-2, atol=1e-5)
FP32 = dict(rtol=1e-5, atol=1e-5)
EXACT = dict(rtol=0.0, atol=0.0)
ATTENTION = dict(rtol=1.6e-2, atol=2e-2)

# Shapes: the tiny target's (4 heads of 512, window 128, 64 experts top-6, hc 4 x 64, 2 groups of
# 2 heads for wo_a) at a prefill and a decode step, and others (more heads, padded heads, a smaller
# block, compressed slots, other expert and stream counts).
CASES = {
    "tiny-prefill": dict(tokens=85, heads=4, padded=4, block=64, window=128, compressed=0,
                         experts=64, topk=6, hc=4, dim=64, groups=2, rank=64),
    "tiny-decode": dict(tokens=2, heads=4, padded=4, block=64, window=128, compressed=0,
                        experts=64, topk=6, hc=4, dim=64, groups=2, rank=64),
    "other": dict(tokens=7, heads=8, padded=10, block=32, window=24, compressed=16,
                  experts=128, topk=6, hc=2, dim=96, groups=4, rank=32),
}  # fmt: skip
LOOP_CASES = ["tiny-decode", "other"]
NUM_BLOCKS = 6


def cos_sin_cache(max_pos: int = 4096) -> Tensor:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, cs.ROPE_DIM, 2).float() / cs.ROPE_DIM)
    angles = torch.arange(max_pos).float()[:, None] * inv_freq
    return torch.cat((angles.cos(), angles.sin()), dim=-1).contiguous()


def random_slots(g: torch.Generator, rows: int, width: int, block: int) -> Tensor:
    """Slots into a NUM_BLOCKS cache, some -1 and some past its end (both invalid)."""
    slots = torch.randint(0, NUM_BLOCKS * block, (rows, width), generator=g)
    roll = torch.rand(rows, width, generator=g)
    slots[roll < 0.15] = -1
    slots[roll > 0.95] = NUM_BLOCKS * block + 3
    slots[0] = -1  # a token that sees nothing
    return slots


def random_fp8_ds_mla_cache(g: torch.Generator, block: int) -> Tensor:
    """A cache of valid rows: fp8 NoPE (no subnormals, as the writer never stores them), UE8M0
    scales 2**-2 to 2**1, bf16 RoPE, zero pad byte."""
    tokens = NUM_BLOCKS * block
    nope = torch.randn(tokens, cs.NOPE_DIM, generator=g)
    nope = torch.where(nope.abs() < cs.FP8_MIN_NORMAL, 0.0, nope).to(torch.float8_e4m3fn)
    rope = torch.randn(tokens, cs.ROPE_DIM, generator=g).to(torch.bfloat16)
    exponents = torch.randint(125, 129, (tokens, cs.SCALE_BYTES - 1), generator=g).to(torch.uint8)
    pad = torch.zeros(tokens, 1, dtype=torch.uint8)
    data = torch.cat((nope.view(torch.uint8), rope.view(torch.uint8)), 1).view(NUM_BLOCKS, -1)
    scales = torch.cat((exponents, pad), 1).view(NUM_BLOCKS, -1)
    return torch.cat((data, scales), dim=1).contiguous()


def inputs(op: str, case: str, seed: int) -> tuple:
    """Fresh random arguments for ``op`` (the same ones again for the same seed)."""
    c = CASES[case]
    g = torch.Generator().manual_seed(seed)
    T, H, D = c["tokens"], c["heads"], cs.NOPE_DIM + cs.ROPE_DIM

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    positions = torch.randint(0, 4096, (T,), generator=g)
    if op == "bmm_cpu":
        k = H // c["groups"] * D
        weight = randn(c["groups"], c["rank"], k, dtype=torch.bfloat16)
        out = torch.empty(c["groups"], T, c["rank"], dtype=torch.bfloat16)
        return out, randn(c["groups"], T, k, dtype=torch.bfloat16), weight, True, None
    if op == "fused_qnorm_rope_kv_insert_cpu":
        cache = torch.randint(0, 256, (NUM_BLOCKS, c["block"] * (cs.TOKEN_BYTES + cs.SCALE_BYTES)),
                              generator=g, dtype=torch.uint8)  # fmt: skip
        slots = torch.randperm(NUM_BLOCKS * c["block"], generator=g)[: T - 1]
        slots[slots % 3 == 0] = -1  # rows that are not inserted
        q, kv = randn(T, H, D, dtype=torch.bfloat16), randn(T, D, dtype=torch.bfloat16) * 3
        return q, kv, positions, cache, slots, cos_sin_cache(), c["padded"], 1e-6, c["block"]
    if op == "flash_mla_with_kvcache_cpu":
        out = torch.empty(T, H, D, dtype=torch.bfloat16)
        q = randn(T, H, D, dtype=torch.bfloat16) / 4
        window = random_fp8_ds_mla_cache(g, c["block"])
        compressed_block = c["block"] // 4
        compressed = random_fp8_ds_mla_cache(g, compressed_block)
        return (out, q, window, random_slots(g, T, c["window"], c["block"]), c["block"],
                compressed, random_slots(g, T, c["compressed"], compressed_block),
                compressed_block, randn(H), D**-0.5)  # fmt: skip
    if op == "inverse_gptj_rope_o_proj_cpu":
        return randn(T, H, D, dtype=torch.bfloat16), positions, cos_sin_cache(), cs.ROPE_DIM
    if op == "biased_topk_cpu":
        gating = randn(T, c["experts"]) * 2
        bias = randn(c["experts"]) * 0.3
        return gating, gating, bias, c["topk"], True, "sqrtsoftplus", 0, 1.5, True
    hc, d = c["hc"], c["dim"]
    x = randn(T, hc, d, dtype=torch.bfloat16)
    if op == "hc_pre_fused_cpu":
        mix = (2 + hc) * hc
        fn = randn(mix, hc * d) / math.sqrt(hc * d)
        return x, fn, randn(3) * 0.3 + 1, randn(mix) * 0.5, hc, 20, 1e-6, 1e-6
    if op == "hc_post_fused_cpu":
        post = torch.sigmoid(randn(T, hc)) * 2
        comb = torch.softmax(randn(T, hc, hc), dim=-1)
        return randn(T, d, dtype=torch.bfloat16), x, post, comb
    assert op == "hc_head_fused_cpu"
    fn = randn(hc, hc * d) / math.sqrt(hc * d)
    return x, fn, randn(1) * 0.3 + 1, randn(hc) * 0.5, 1e-6, 1e-6


def mutated_args(op: str) -> list[int]:
    """Positions of the arguments the op writes (``Tensor(a!)`` in its schema)."""
    schema = cs.CPP_STANDINS[op][0]
    return [i for i, arg in enumerate(schema.split("->")[0].split(",")) if "(a!)" in arg]


def results(op: str, impl: Callable, args: tuple) -> list[Tensor]:
    """What the op returns, then the arguments it writes."""
    returned = impl(*args)
    if returned is None:
        returned = ()
    elif isinstance(returned, Tensor):
        returned = (returned,)
    return [*returned, *(args[i] for i in mutated_args(op))]


def with_packing(bmm: Callable, pack: Callable) -> Callable:
    """``bmm_cpu`` reads what ``convert_weight_packed`` packed: the two are checked as a pair."""

    def packed_bmm(out, mat1, weight, is_vnni, scale):
        return bmm(out, mat1, pack(weight), is_vnni, scale)

    return packed_bmm


def standin(op: str) -> Callable:
    if op == "bmm_cpu":
        return with_packing(cs.bmm_cpu, cs.convert_weight_packed)
    return cs.CPP_STANDINS[op][1]


def real_op(op: str) -> Callable:
    if op == "bmm_cpu":
        return with_packing(torch.ops._C.bmm_cpu, torch.ops._C.convert_weight_packed)
    return getattr(torch.ops._C, op)


# --- Plain references, written per token from each kernel's documented semantics ---------------


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """GPT-J: pair i is (x[2i], x[2i+1]), rotated by (cos[i], sin[i])."""
    out = x.clone()
    for i in range(cs.ROPE_DIM // 2):
        e, o = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., 2 * i] = e * cos[i] - o * sin[i]
        out[..., 2 * i + 1] = e * sin[i] + o * cos[i]
    return out


def loop_bmm(out, mat1, weight, is_vnni, scale):
    for b in range(weight.shape[0]):
        out[b] = (mat1[b].float() @ weight[b].float().T).to(out.dtype)


def loop_qnorm_rope_kv_insert(q, kv, positions, cache, slots, cos_sin, padded, eps, block):
    T, H, D = q.shape
    nope = D - cs.ROPE_DIM
    q_out = torch.zeros(T, padded, D, dtype=q.dtype)
    for t in range(T):
        cos, sin = cos_sin[positions[t], :32], cos_sin[positions[t], 32:]
        for h in range(H):
            row = q[t, h].float()
            row = row / torch.sqrt((row * row).sum() / D + eps)
            row[nope:] = rotate_pairs(row[nope:], cos, sin)
            q_out[t, h] = row.to(q.dtype)
        slot = int(slots[t]) if t < len(slots) else -1
        if slot < 0:
            continue
        row = kv[t].float()
        row[nope:] = rotate_pairs(row[nope:], cos, sin)
        row = row.to(torch.bfloat16).float()
        base, offset = divmod(slot, block)
        data = cache[base, offset * cs.TOKEN_BYTES : (offset + 1) * cs.TOKEN_BYTES]
        scales = cache[base, block * cs.TOKEN_BYTES + offset * cs.SCALE_BYTES :][: cs.SCALE_BYTES]
        for tile in range(nope // cs.QUANT_TILE):
            values = row[tile * cs.QUANT_TILE : (tile + 1) * cs.QUANT_TILE]
            exponent = math.ceil(math.log2(max(float(values.abs().max()) / 448.0, 1e-4)))
            scaled = (values / 2.0**exponent).clamp(-448, 448)
            scaled[scaled.abs() < 2**-6] *= 0  # flushed to a signed zero
            data[tile * 64 : (tile + 1) * 64] = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
            scales[tile] = exponent + 127
        scales[-1] = 0
        data[nope:] = row[nope:].to(torch.bfloat16).view(torch.uint8)
    return q_out


def decode_row(cache: Tensor, slot: int, block: int) -> Tensor | None:
    """The 512 bf16 values a fp8_ds_mla slot holds, or None if the slot is not in the cache."""
    if slot < 0 or slot >= cache.shape[0] * block:
        return None
    base, offset = divmod(slot, block)
    data = cache[base, offset * cs.TOKEN_BYTES : (offset + 1) * cs.TOKEN_BYTES]
    exponents = cache[base, block * cs.TOKEN_BYTES + offset * cs.SCALE_BYTES :][:7]
    nope = data[: cs.NOPE_DIM].view(torch.float8_e4m3fn).float()
    for tile, exponent in enumerate(exponents.tolist()):
        nope[tile * 64 : (tile + 1) * 64] *= 2.0 ** (exponent - 127)
    return torch.cat((nope.to(torch.bfloat16), data[cs.NOPE_DIM :].view(torch.bfloat16)))


def loop_flash_mla(out, q, window, window_slots, wb, compressed, compressed_slots, cb, sink, scale):
    for t in range(q.shape[0]):
        rows = [decode_row(window, int(s), wb) for s in window_slots[t]]
        rows += [decode_row(compressed, int(s), cb) for s in compressed_slots[t]]
        keys = [r.float() for r in rows if r is not None]
        for h in range(q.shape[1]):
            if not keys:
                out[t, h] = 0
                continue
            logits = [float(q[t, h].float() @ k) * scale for k in keys]
            top = max(logits)
            weights = [math.exp(s - top) for s in logits]
            total = sum(weights) + math.exp(float(sink[h]) - top)
            out[t, h] = sum(w / total * k for w, k in zip(weights, keys, strict=True))


def loop_inverse_rope(o, positions, cos_sin, rope_dim):
    out = o.float()
    for t in range(o.shape[0]):
        cos, sin = cos_sin[positions[t], :32], cos_sin[positions[t], 32:]
        out[t, :, -rope_dim:] = rotate_pairs(out[t, :, -rope_dim:], cos, -sin)
    return out


def loop_biased_topk(hidden, gating, bias, topk, renorm, scoring, shared, factor, on_output):
    weights, ids = [], []
    for row in gating.tolist():
        scores = [math.sqrt(math.log1p(math.exp(x))) for x in row]
        ranked = sorted(range(len(row)), key=lambda e: -(scores[e] + float(bias[e])))[:topk]
        chosen = [scores[e] for e in ranked]
        weights.append([w / sum(chosen) * factor for w in chosen])
        ids.append(ranked)
    return torch.tensor(weights), torch.tensor(ids, dtype=torch.int32)


def loop_hc_pre(x, fn, hc_scale, hc_base, hc, iters, rms_eps, hc_eps):
    T = x.shape[0]
    ys, posts, combs = [], [], []
    for t in range(T):
        flat = x[t].float().flatten()
        mix = (fn @ flat) / torch.sqrt((flat * flat).mean() + rms_eps)
        pre = torch.sigmoid(mix[:hc] * hc_scale[0] + hc_base[:hc]) + hc_eps
        posts.append(2 * torch.sigmoid(mix[hc : 2 * hc] * hc_scale[1] + hc_base[hc : 2 * hc]))
        comb = (mix[2 * hc :] * hc_scale[2] + hc_base[2 * hc :]).view(hc, hc)
        comb = torch.exp(comb - comb.max(dim=1, keepdim=True).values)
        for i in range(iters):
            for r in range(hc):  # rows: the first pass is the softmax, plus eps
                comb[r] = (
                    comb[r] / comb[r].sum() + hc_eps
                    if i == 0
                    else comb[r] / (comb[r].sum() + hc_eps)
                )
            for c in range(hc):
                comb[:, c] = comb[:, c] / (comb[:, c].sum() + hc_eps)
        combs.append(comb)
        ys.append(sum(pre[h] * x[t, h].float() for h in range(hc)).to(x.dtype))
    return torch.stack(ys), torch.stack(posts), torch.stack(combs)


def loop_hc_post(x, residual, post, comb):
    out = torch.empty_like(residual)
    for t in range(x.shape[0]):
        for h in range(residual.shape[1]):
            mixed = sum(comb[t, i, h] * residual[t, i].float() for i in range(residual.shape[1]))
            out[t, h] = (post[t, h] * x[t].float() + mixed).to(out.dtype)
    return out


def loop_hc_head(x, fn, hc_scale, hc_base, hc_eps, norm_eps):
    out = torch.empty(x.shape[0], x.shape[2], dtype=x.dtype)
    for t in range(x.shape[0]):
        flat = x[t].float().flatten()
        gates = torch.sigmoid((fn @ flat) / torch.sqrt((flat * flat).mean() + norm_eps) * hc_scale
                              + hc_base) + hc_eps  # fmt: skip
        out[t] = sum(gates[h] * x[t, h].float() for h in range(x.shape[1])).to(x.dtype)
    return out


REFERENCES: dict[str, tuple[Callable, list[dict]]] = {
    "bmm_cpu": (loop_bmm, [BF16]),
    "fused_qnorm_rope_kv_insert_cpu": (loop_qnorm_rope_kv_insert, [BF16, EXACT]),
    "flash_mla_with_kvcache_cpu": (loop_flash_mla, [ATTENTION]),
    "inverse_gptj_rope_o_proj_cpu": (loop_inverse_rope, [FP32]),
    "biased_topk_cpu": (loop_biased_topk, [FP32, EXACT]),
    "hc_pre_fused_cpu": (loop_hc_pre, [BF16, FP32, FP32]),
    "hc_post_fused_cpu": (loop_hc_post, [BF16]),
    "hc_head_fused_cpu": (loop_hc_head, [BF16]),
}
OPS = list(REFERENCES)  # convert_weight_packed is checked with bmm_cpu, its only reader


def assert_same(op: str, impl: Callable, reference: Callable, case: str, seed: int) -> None:
    got = results(op, impl, inputs(op, case, seed))
    want = results(op, reference, inputs(op, case, seed))
    assert len(got) == len(want)
    for g, w, tolerance in zip(got, want, REFERENCES[op][1], strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        torch.testing.assert_close(g, w, equal_nan=True, **tolerance)


def has_the_real(op: str) -> bool:
    """Whether ``torch.ops._C.<op>`` is the extension's own (not a stand-in installed earlier)."""
    return op not in cs.missing_cpp_ops() and op not in cs.INSTALLED


def test_every_missing_op_has_a_check():
    assert {*OPS, "convert_weight_packed"} == set(cs.DEEPSEEK_V4_CPP_OPS)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("op", OPS)
def test_standin_matches_the_real_op(op: str, case: str):
    if not has_the_real(op) or (op == "bmm_cpu" and not has_the_real("convert_weight_packed")):
        pytest.skip(f"this host's vLLM extension lacks the real {op} to compare with")
    assert_same(op, standin(op), real_op(op), case, seed=1)


@pytest.mark.parametrize("op", cs.DEEPSEEK_V4_CPP_OPS)
def test_standin_schema_is_the_real_one(op: str):
    if not has_the_real(op):
        pytest.skip(f"this host's vLLM extension lacks the real {op} to compare with")
    real = str(getattr(torch.ops._C, op).default._schema).replace("($0! -> )", "")
    assert real == f"_C::{op}{cs.CPP_STANDINS[op][0]}"


@pytest.mark.parametrize("case", LOOP_CASES)
@pytest.mark.parametrize("op", OPS)
def test_standin_matches_the_loop_reference(op: str, case: str):
    assert_same(op, standin(op), REFERENCES[op][0], case, seed=2)


def shift_positions(impl: Callable) -> Callable:
    """Wrong RoPE phase: every token rotated as if one position later."""
    return lambda q, kv, positions, *rest: impl(q, kv, positions + 1, *rest)


def forward_rope_instead_of_inverse(o, positions, cos_sin, rope_dim):
    """Rotates forward where the op undoes the rotation."""
    out = o.float()
    cos, sin = cos_sin[positions, :32], cos_sin[positions, 32:]
    out[..., -rope_dim:] = cs.gptj_rope(out[..., -rope_dim:], cos[:, None], sin[:, None])
    return out


def post_gate_times_one(x, fn, hc_scale, hc_base, hc, iters, rms_eps, hc_eps):
    """The post gate without the kernel's fixed multiplier 2."""
    from vllm.model_executor.kernels.mhc.torch import mhc_pre_torch

    post, comb, y = mhc_pre_torch(x, fn, hc_scale, hc_base, rms_eps, hc_eps, hc_eps, 1.0, iters)
    return y, post.squeeze(-1), comb


MUTANTS: dict[str, Callable] = {
    "bmm_cpu": lambda out, mat1, w, *rest: standin("bmm_cpu")(out, mat1, w.flip(0), *rest),
    "fused_qnorm_rope_kv_insert_cpu": shift_positions(cs.fused_qnorm_rope_kv_insert_cpu),
    "flash_mla_with_kvcache_cpu": lambda *args: cs.flash_mla_with_kvcache_cpu(*args[:-1], 1.0),
    "inverse_gptj_rope_o_proj_cpu": forward_rope_instead_of_inverse,
    "biased_topk_cpu": lambda h, g, bias, *rest: cs.biased_topk_cpu(h, g, bias * 0, *rest),
    "hc_pre_fused_cpu": post_gate_times_one,
    "hc_post_fused_cpu": lambda x, r, post, comb: cs.hc_post_fused_cpu(
        x, r, post, comb.transpose(1, 2).contiguous()
    ),
    "hc_head_fused_cpu": lambda x, fn, scale, *rest: cs.hc_head_fused_cpu(
        x, fn, torch.ones_like(scale), *rest
    ),
}


@pytest.mark.parametrize("op", OPS)
def test_the_loop_check_catches_a_wrong_variant(op: str):
    """Groups off by one, RoPE phase off by one position or inverted, the softmax scale, the
    routing bias or the post multiplier missing, the mix transposed: each fails the comparison
    that the stand-in passes."""
    with pytest.raises(AssertionError):
        assert_same(op, MUTANTS[op], REFERENCES[op][0], "tiny-decode", seed=2)
