# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The greedy Markov chain in k + 1 Triton launches instead of about four per position.

One launch a position: each program takes one block of the vocabulary for one request,
computes that block's ``W2 · W1[previous token]`` bias, adds the base logits and writes the
block's maximum and its token. The next position's programs first take the argmax over the
previous position's block maxima themselves, which gives the previous token (program 0 writes
it into the drafts), and the last position's tokens get one small launch. This is the layout
of upstream's fused Markov step (``vllm/models/deepseek_v41/amd/ops/fused_markov.py``) with its
Gumbel draw replaced by the plain maximum, so it drafts what ``markov_chain``'s greedy loop
does: the bias is rounded to the weights' dtype and added to the base logits with one rounding,
as a tensor add does, and equal maxima keep the first token, as ``argmax`` does. The bias sums
its products in another order than a GEMM does, so at bf16 a near-tie can differ in its last
bit.

This module imports Triton itself: tests run the kernels under ``TRITON_INTERPRET=1`` on CPU.
"""

import torch
import triton
import triton.language as tl

# Vocabulary tokens a program: 152k tokens give about 600 programs a request.
BLOCK = 256
# Markov-rank columns a program multiplies at a time.
K_CHUNK = 64


@triton.jit
def _greedy_step_kernel(
    prev_max_ptr,  # [B, num_blocks] the previous position's block maxima
    prev_arg_ptr,  # [B, num_blocks] their tokens
    anchor_ptr,  # [B] position 0's previous token
    drafts_ptr,  # [B, n] int64
    drafts_stride,
    w1_ptr,  # [target vocab, RANK] the Markov embedding
    w2_ptr,  # [>= vocab, RANK] the bias head
    base_ptr,  # this position's base logits of request r at r * base_stride + v
    base_stride,
    out_max_ptr,
    out_arg_ptr,
    vocab,
    num_blocks,
    STEP: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK: tl.constexpr,
    K_CHUNK: tl.constexpr,
    BLOCKS_POW2: tl.constexpr,
):
    b = tl.program_id(0)
    r = tl.program_id(1)
    v = b * BLOCK + tl.arange(0, BLOCK)
    vmask = v < vocab
    if STEP == 0:
        prev = tl.load(anchor_ptr + r).to(tl.int64)
    else:
        j = tl.arange(0, BLOCKS_POW2)
        m = tl.load(prev_max_ptr + r * num_blocks + j, mask=j < num_blocks, other=float("-inf"))
        best = tl.argmax(m, axis=0, tie_break_left=True)
        prev = tl.load(prev_arg_ptr + r * num_blocks + best)
        if b == 0:
            tl.store(drafts_ptr + r * drafts_stride + (STEP - 1), prev)
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
    logits = tl.where(vmask, (base + bias).to(dtype).to(tl.float32), float("-inf"))
    value, idx = tl.max(logits, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_max_ptr + r * num_blocks + b, value)
    tl.store(out_arg_ptr + r * num_blocks + b, (b * BLOCK + idx).to(tl.int64))


@triton.jit
def _greedy_last_kernel(
    prev_max_ptr,
    prev_arg_ptr,
    drafts_ptr,
    drafts_stride,
    num_blocks,
    STEP: tl.constexpr,
    BLOCKS_POW2: tl.constexpr,
):
    r = tl.program_id(0)
    j = tl.arange(0, BLOCKS_POW2)
    m = tl.load(prev_max_ptr + r * num_blocks + j, mask=j < num_blocks, other=float("-inf"))
    best = tl.argmax(m, axis=0, tie_break_left=True)
    tl.store(drafts_ptr + r * drafts_stride + STEP, tl.load(prev_arg_ptr + r * num_blocks + best))


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
    num_requests, num_positions, vocab = base_logits.shape
    rank = w1.shape[1]
    num_blocks = triton.cdiv(vocab, BLOCK)
    blocks_pow2 = triton.next_power_of_2(num_blocks)
    device = base_logits.device
    maxima = torch.empty(2, num_requests, num_blocks, dtype=torch.float32, device=device)
    tokens = torch.empty(2, num_requests, num_blocks, dtype=torch.int64, device=device)
    for step in range(num_positions):
        _greedy_step_kernel[(num_blocks, num_requests)](
            maxima[(step + 1) % 2],
            tokens[(step + 1) % 2],
            anchor_tokens,
            drafts,
            drafts.stride(0),
            w1,
            w2,
            base_logits[:, step],
            base_logits.stride(0),
            maxima[step % 2],
            tokens[step % 2],
            vocab,
            num_blocks,
            STEP=step,
            RANK=rank,
            BLOCK=BLOCK,
            K_CHUNK=min(K_CHUNK, rank),
            BLOCKS_POW2=blocks_pow2,
        )
    last = (num_positions - 1) % 2
    _greedy_last_kernel[(num_requests,)](
        maxima[last],
        tokens[last],
        drafts,
        drafts.stride(0),
        num_blocks,
        STEP=num_positions - 1,
        BLOCKS_POW2=blocks_pow2,
    )
