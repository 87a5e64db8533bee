# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Markov chain in k + 1 Triton launches instead of about four (greedy) or about ten
(probabilistic) per position.

One launch a position: each program takes one block of the vocabulary for one request,
computes that block's ``W2 · W1[previous token]`` bias, adds the base logits and writes the
block's best score and its token. The next position's programs first take the best of the
previous position's block scores themselves, which gives the previous token (program 0 writes
it into the drafts), and the last position's tokens get one more launch. This is the layout of
upstream's fused Markov step (``vllm/models/deepseek_v41/amd/ops/fused_markov.py``).

Greedy drafts score a token by its logit, so they draft what ``markov_chain``'s greedy loop
does: the bias is rounded to the weights' dtype and added to the base logits with one rounding,
as a tensor add does, and equal maxima keep the first token, as ``argmax`` does. The bias sums
its products in another order than a GEMM does, so at bf16 a near-tie can differ in its last
bit.

Sampled drafts are vLLM's draft sampler in Gumbel form: a token's score is its logit over the
request's temperature plus Gumbel noise ``-log(-log u)``, whose maximum is a draw from the
softmax that vLLM's ``argmax(probs / Exp(1))`` draws from (rows under vLLM's greedy threshold
take temperature 1 and no noise, as its sampler does). Each program also writes its block's
scaled logits into the distributions buffer with their maximum and exponential sum, and the
next launch, which reduces those, rewrites the block as the softmax, so the distributions that
rejection sampling reads are the ones the drafts were drawn from. The uniforms are Philox
draws keyed by a seed read from a device tensor, the request and the position: the caller
draws the seed from torch's generator, so a CUDA graph replays fresh noise and a replay under a
seed draws what the eager chain does under it.

This module imports Triton itself: tests run the kernels under ``TRITON_INTERPRET=1`` on CPU.
"""

import torch
import triton
import triton.language as tl

from vllm.v1.sample.sampler import _SAMPLING_EPS

# Vocabulary tokens a program: 152k tokens give about 600 programs a request.
BLOCK = 256
# Markov-rank columns a program multiplies at a time.
K_CHUNK = 64


@triton.jit
def _take_previous(
    prev_score_ptr,  # [B, num_blocks] the previous position's best block scores
    prev_arg_ptr,  # [B, num_blocks] their tokens
    drafts_ptr,
    drafts_stride,
    r,
    num_blocks,
    STEP: tl.constexpr,
    BLOCKS_POW2: tl.constexpr,
):
    """Position ``STEP``'s token of request ``r`` from its block scores (first on ties)."""
    j = tl.arange(0, BLOCKS_POW2)
    m = tl.load(prev_score_ptr + r * num_blocks + j, mask=j < num_blocks, other=float("-inf"))
    best = tl.argmax(m, axis=0, tie_break_left=True)
    token = tl.load(prev_arg_ptr + r * num_blocks + best)
    if tl.program_id(0) == 0:
        tl.store(drafts_ptr + r * drafts_stride + STEP, token)
    return token


@triton.jit
def _normalize_block(
    probs_ptr,  # position STEP's row of request r, at r * probs_stride + v
    probs_stride,
    max_ptr,  # [B, num_blocks] block maxima of the scaled logits
    sum_ptr,  # [B, num_blocks] their exponential sums
    r,
    v,
    vmask,
    num_blocks,
    BLOCKS_POW2: tl.constexpr,
):
    """Rewrite this program's block of scaled logits as the softmax over the vocabulary."""
    j = tl.arange(0, BLOCKS_POW2)
    jmask = j < num_blocks
    block_max = tl.load(max_ptr + r * num_blocks + j, mask=jmask, other=float("-inf"))
    block_sum = tl.load(sum_ptr + r * num_blocks + j, mask=jmask, other=0.0)
    total_max = tl.max(block_max, axis=0)
    total = tl.sum(block_sum * tl.exp(block_max - total_max), axis=0)
    row = probs_ptr + r * probs_stride + v
    x = tl.load(row, mask=vmask, other=0.0)
    tl.store(row, tl.exp(x - total_max) / total, mask=vmask)


@triton.jit
def _step_kernel(
    prev_score_ptr,
    prev_arg_ptr,
    prev_max_ptr,  # [B, num_blocks] the previous position's block maxima (sampled)
    prev_sum_ptr,  # [B, num_blocks] and exponential sums (sampled)
    anchor_ptr,  # [B] position 0's previous token
    drafts_ptr,  # [B, n] int64
    drafts_stride,
    w1_ptr,  # [target vocab, RANK] the Markov embedding
    w2_ptr,  # [>= vocab, RANK] the bias head
    base_ptr,  # this position's base logits of request r at r * base_stride + v
    base_stride,
    temperature_ptr,  # [B] float32 (sampled)
    seed_ptr,  # [1] int64 (sampled)
    probs_ptr,  # [B, n, V] float32 at r * probs_stride + step * probs_step_stride + v (sampled)
    probs_stride,
    probs_step_stride,
    out_score_ptr,
    out_arg_ptr,
    out_max_ptr,
    out_sum_ptr,
    vocab,
    num_blocks,
    STEP: tl.constexpr,
    SAMPLED: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK: tl.constexpr,
    K_CHUNK: tl.constexpr,
    BLOCKS_POW2: tl.constexpr,
    SAMPLING_EPS: tl.constexpr,
):
    b = tl.program_id(0)
    r = tl.program_id(1)
    v = b * BLOCK + tl.arange(0, BLOCK)
    vmask = v < vocab
    if STEP == 0:
        prev = tl.load(anchor_ptr + r).to(tl.int64)
    else:
        prev = _take_previous(
            prev_score_ptr,
            prev_arg_ptr,
            drafts_ptr,
            drafts_stride,
            r,
            num_blocks,
            STEP - 1,
            BLOCKS_POW2,
        )
        if SAMPLED:
            _normalize_block(
                probs_ptr + (STEP - 1) * probs_step_stride,
                probs_stride,
                prev_max_ptr,
                prev_sum_ptr,
                r,
                v,
                vmask,
                num_blocks,
                BLOCKS_POW2,
            )
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in tl.static_range(0, RANK, K_CHUNK):
        k = k0 + tl.arange(0, K_CHUNK)
        w = tl.load(
            w2_ptr + v[:, None].to(tl.int64) * RANK + k[None, :], mask=vmask[:, None], other=0.0
        ).to(tl.float32)
        e = tl.load(w1_ptr + prev * RANK + k).to(tl.float32)
        acc += tl.sum(w * e[None, :], axis=1)
    dtype = base_ptr.dtype.element_ty
    bias = acc.to(dtype).to(tl.float32)
    base = tl.load(base_ptr + r * base_stride + v, mask=vmask, other=0.0).to(tl.float32)
    score = tl.where(vmask, (base + bias).to(dtype).to(tl.float32), float("-inf"))
    if SAMPLED:
        temperature = tl.load(temperature_ptr + r)
        greedy = temperature < SAMPLING_EPS
        temperature = tl.where(greedy, 1.0, temperature)
        # vLLM divides the logits in their dtype, then takes the softmax in float32.
        scaled = tl.where(vmask, (score / temperature).to(dtype).to(tl.float32), float("-inf"))
        tl.store(probs_ptr + STEP * probs_step_stride + r * probs_stride + v, scaled, mask=vmask)
        block_max = tl.max(scaled, axis=0)
        tl.store(out_max_ptr + r * num_blocks + b, block_max)
        tl.store(out_sum_ptr + r * num_blocks + b, tl.sum(tl.exp(scaled - block_max), axis=0))
        u = tl.rand(tl.load(seed_ptr) + r, STEP * vocab + v)
        gumbel = tl.where(greedy, 0.0, -tl.log(-tl.log(u)))
        score = scaled + gumbel
    value, idx = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_score_ptr + r * num_blocks + b, value)
    tl.store(out_arg_ptr + r * num_blocks + b, (b * BLOCK + idx).to(tl.int64))


@triton.jit
def _last_kernel(
    prev_score_ptr,
    prev_arg_ptr,
    prev_max_ptr,
    prev_sum_ptr,
    drafts_ptr,
    drafts_stride,
    probs_ptr,  # the last position's rows (sampled)
    probs_stride,
    vocab,
    num_blocks,
    STEP: tl.constexpr,
    SAMPLED: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS_POW2: tl.constexpr,
):
    r = tl.program_id(1)
    _take_previous(
        prev_score_ptr, prev_arg_ptr, drafts_ptr, drafts_stride, r, num_blocks, STEP, BLOCKS_POW2
    )
    if SAMPLED:
        v = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        _normalize_block(
            probs_ptr,
            probs_stride,
            prev_max_ptr,
            prev_sum_ptr,
            r,
            v,
            v < vocab,
            num_blocks,
            BLOCKS_POW2,
        )


def supported(w1: torch.Tensor, w2: torch.Tensor, base_logits: torch.Tensor) -> bool:
    """Whether the kernels take these weights and ``[B, n, V]`` base logits: one dtype for all
    three (the kernels round the bias and the sum to it)."""
    rank = w1.shape[1]
    return (
        w1.dtype == w2.dtype == base_logits.dtype
        and w2.shape[1] == rank
        and rank % min(K_CHUNK, rank) == 0
        and rank & (rank - 1) == 0
        and w2.shape[0] >= base_logits.shape[-1]
        and w1.is_contiguous()
        and w2.is_contiguous()
        and base_logits.stride(-1) == 1
    )


def greedy_markov_chain(
    base_logits: torch.Tensor,
    anchor_tokens: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    drafts: torch.Tensor,
) -> None:
    """Write into ``drafts`` (``[B, >= n]`` int64) the greedy chain over ``base_logits``
    ``[B, n, V]`` from ``anchor_tokens`` ``[B]`` (any integer dtype): n + 1 launches."""
    _chain(base_logits, anchor_tokens, w1, w2, drafts, None)


def sampled_markov_chain(
    base_logits: torch.Tensor,
    anchor_tokens: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    drafts: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    probs: torch.Tensor,
) -> None:
    """As ``greedy_markov_chain``, drawing each position's token at ``temperature`` (``[B]``
    float32) with the noise of ``seed`` (``[1]`` int64, request r draws with ``seed + r``);
    the distributions go into ``probs`` (``[B, n, V]`` float32, last dimension contiguous)."""
    _chain(base_logits, anchor_tokens, w1, w2, drafts, (temperature, seed, probs))


def _chain(
    base_logits: torch.Tensor,
    anchor_tokens: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    drafts: torch.Tensor,
    sampling: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    num_requests, num_positions, vocab = base_logits.shape
    num_blocks = triton.cdiv(vocab, BLOCK)
    blocks_pow2 = triton.next_power_of_2(num_blocks)
    # Per block of each request: best score, its token, maximum and exponential sum, for two
    # positions (the one written and the one read).
    scratch = torch.empty(4, 2, num_requests, num_blocks, dtype=torch.float32, device=drafts.device)
    score, maximum, total = scratch[0], scratch[2], scratch[3]
    tokens = torch.empty(2, num_requests, num_blocks, dtype=torch.int64, device=drafts.device)
    temperature, seed, probs = sampling if sampling is not None else (scratch, scratch, scratch)
    sampled = sampling is not None
    for step in range(num_positions):
        read, write = (step + 1) % 2, step % 2
        _step_kernel[(num_blocks, num_requests)](
            score[read],
            tokens[read],
            maximum[read],
            total[read],
            anchor_tokens,
            drafts,
            drafts.stride(0),
            w1,
            w2,
            base_logits[:, step],
            base_logits.stride(0),
            temperature,
            seed,
            probs,
            probs.stride(0),
            probs.stride(1),
            score[write],
            tokens[write],
            maximum[write],
            total[write],
            vocab,
            num_blocks,
            STEP=step,
            SAMPLED=sampled,
            RANK=w1.shape[1],
            BLOCK=BLOCK,
            K_CHUNK=min(K_CHUNK, w1.shape[1]),
            BLOCKS_POW2=blocks_pow2,
            SAMPLING_EPS=_SAMPLING_EPS,
        )
    last = (num_positions - 1) % 2
    _last_kernel[(num_blocks if sampled else 1, num_requests)](
        score[last],
        tokens[last],
        maximum[last],
        total[last],
        drafts,
        drafts.stride(0),
        probs[:, num_positions - 1] if sampled else probs,
        probs.stride(0),
        vocab,
        num_blocks,
        STEP=num_positions - 1,
        SAMPLED=sampled,
        BLOCK=BLOCK,
        BLOCKS_POW2=blocks_pow2,
    )
