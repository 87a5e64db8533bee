# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Markov chain in one Triton launch, or n + 1, instead of about four (greedy) or about ten
(probabilistic) launches a position.

Each program takes blocks of the vocabulary for a tile of up to 32 requests and computes a
block's ``W2 · W1[previous token]`` bias for every request of the tile in one ``tl.dot`` (so W2
is read once a position, not once a request), adds the base logits and keeps each request's
best score and its token. This is the layout of upstream's fused Markov step
(``vllm/models/deepseek_v41/amd/ops/fused_markov.py``), with requests tiled. A position's
token needs every block's best, so positions meet in one of two ways:

- One cooperative launch for the block (``_chain_kernel``): the programs of a tile, all
  resident at once, meet at a grid barrier after each position (PyTorch's
  ``x_grid_barrier``, the one its cooperative reductions use) and each takes the position's
  tokens from the others' best scores. ``prepare`` turns it on for a CUDA device once the draft
  has loaded, after it drafted there what the per-position kernels draft, eagerly and from a
  CUDA graph.
- One launch a position (``_step_kernel``), whose programs take one block each and first take
  the best of the previous position's block scores themselves, and one more for the last
  position's tokens (``_last_kernel``): where the one launch is off.

Greedy drafts score a token by its logit, so they draft what ``markov_chain``'s greedy loop
does: the bias is rounded to the weights' dtype and added to the base logits with one rounding,
as a tensor add does, and equal maxima keep the first token, as ``argmax`` does. The bias sums
its products in another order than a GEMM does, so at bf16 a near-tie can differ in its last
bit.

Sampled drafts are vLLM's draft sampler in Gumbel form: a token's score is its logit over the
request's temperature plus Gumbel noise ``-log(-log u)``, whose maximum is a draw from the
softmax that vLLM's ``argmax(probs / Exp(1))`` draws from (rows under vLLM's greedy threshold
take temperature 1 and no noise, as its sampler does). Each program also writes its block's
scaled logits into the distributions buffer with their maximum and exponential sum, and once
the position's blocks are all done (after the barrier, or in the next launch) the block is
rewritten as the softmax, so the distributions that rejection sampling reads are the ones the
drafts were drawn from. The uniforms are Philox
draws keyed by a seed read from a device tensor, the request and the position: the caller
draws the seed from torch's generator, so a CUDA graph replays fresh noise and a replay under a
seed draws what the eager chain does under it.

This module imports Triton itself: tests run the kernels under ``TRITON_INTERPRET=1`` on CPU.
"""

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch._inductor.runtime.triton_helpers import x_grid_barrier

from vllm.logger import init_logger
from vllm.v1.sample.sampler import _SAMPLING_EPS

logger = init_logger(__name__)

# Vocabulary tokens a block: 152k tokens give about 600 blocks.
BLOCK = 256
# Markov-rank columns a program multiplies at a time: at most 64, at least the 16 ``tl.dot``
# takes (a smaller rank is padded with zeros).
K_CHUNK = 64
# Block scores of the previous position a program reduces at a time.
REDUCE_CHUNK = 256
# Requests a program takes: the fewest ``tl.dot`` takes, and the most whose scores one program
# keeps in registers.
MIN_ROWS, MAX_ROWS = 16, 32


@triton.jit
def _take_previous(
    prev_score_ptr,  # [B, num_blocks] the previous position's best block scores
    prev_arg_ptr,  # [B, num_blocks] their tokens
    drafts_ptr,
    drafts_stride,
    rows,
    row_mask,
    num_blocks,
    STEP: tl.constexpr,
    ROWS: tl.constexpr,
    REDUCE_CHUNK: tl.constexpr,
):
    """Position ``STEP``'s tokens of ``rows`` from their block scores (first on ties)."""
    best = tl.full([ROWS], float("-inf"), tl.float32)
    best_block = tl.zeros([ROWS], tl.int32)
    for j0 in range(0, num_blocks, REDUCE_CHUNK):
        j = j0 + tl.arange(0, REDUCE_CHUNK)
        m = tl.load(
            prev_score_ptr + rows[:, None] * num_blocks + j[None, :],
            mask=row_mask[:, None] & (j < num_blocks)[None, :],
            other=float("-inf"),
        )
        value, index = tl.max(m, axis=1, return_indices=True, return_indices_tie_break_left=True)
        # A later chunk wins only with a larger score: equal maxima keep the first token.
        better = value > best
        best_block = tl.where(better, j0 + index, best_block)
        best = tl.where(better, value, best)
    token = tl.load(prev_arg_ptr + rows * num_blocks + best_block, mask=row_mask, other=0)
    if tl.program_id(1) == 0:
        tl.store(drafts_ptr + rows * drafts_stride + STEP, token, mask=row_mask)
    return token


@triton.jit
def _rewrite_as_softmax(
    probs_ptr,  # one position's rows, request r's token v at r * probs_stride + v
    probs_stride,
    total_max,  # [ROWS] the maximum of each row's scaled logits
    total,  # [ROWS] and their exponential sum
    rows,
    row_mask,
    v,
    vmask,
):
    """Rewrite one block of scaled logits as the softmax over the vocabulary."""
    mask = row_mask[:, None] & vmask[None, :]
    block = probs_ptr + rows[:, None] * probs_stride + v[None, :]
    x = tl.load(block, mask=mask, other=0.0)
    tl.store(block, tl.exp(x - total_max[:, None]) / total[:, None], mask=mask)


@triton.jit
def _merge_exp_sums(run_max, run_sum, new_max, new_sum):
    """Two ``(maximum, exponential sum)`` pairs of a row's scaled logits as one (the online
    softmax's merge)."""
    top = tl.maximum(run_max, new_max)
    return top, run_sum * tl.exp(run_max - top) + new_sum * tl.exp(new_max - top)


@triton.jit
def _normalize_block(
    probs_ptr,
    probs_stride,
    max_ptr,  # [B, num_blocks] block maxima of the scaled logits
    sum_ptr,  # [B, num_blocks] their exponential sums
    rows,
    row_mask,
    v,
    vmask,
    num_blocks,
    ROWS: tl.constexpr,
    REDUCE_CHUNK: tl.constexpr,
):
    """Rewrite this program's block of scaled logits as the softmax over the vocabulary."""
    total_max = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    for j0 in range(0, num_blocks, REDUCE_CHUNK):
        j = j0 + tl.arange(0, REDUCE_CHUNK)
        mask = row_mask[:, None] & (j < num_blocks)[None, :]
        block_max = tl.load(
            max_ptr + rows[:, None] * num_blocks + j[None, :], mask=mask, other=float("-inf")
        )
        block_sum = tl.load(sum_ptr + rows[:, None] * num_blocks + j[None, :], mask=mask, other=0.0)
        chunk_max = tl.where(row_mask, tl.max(block_max, axis=1), 0.0)
        chunk_sum = tl.sum(block_sum * tl.exp(block_max - chunk_max[:, None]), axis=1)
        total_max, total = _merge_exp_sums(total_max, total, chunk_max, chunk_sum)
    total = tl.where(row_mask, total, 1.0)
    _rewrite_as_softmax(probs_ptr, probs_stride, total_max, total, rows, row_mask, v, vmask)


@triton.jit
def _block_scores(
    prev,  # [ROWS] int64 each row's previous token
    rows,
    row_mask,
    b,
    w1_ptr,  # [target vocab, RANK] the Markov embedding
    w2_ptr,  # [>= vocab, RANK] the bias head
    base_ptr,  # this position's base logits, request r's token v at r * base_stride + v
    base_stride,
    temperature_ptr,  # [B] float32 (sampled)
    seed_ptr,  # [1] int64 (sampled)
    probs_ptr,  # this position's distributions, at r * probs_stride + v (sampled)
    probs_stride,
    vocab,
    STEP: tl.constexpr,
    SAMPLED: tl.constexpr,
    RANK: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    K_CHUNK: tl.constexpr,
    SAMPLING_EPS: tl.constexpr,
):
    """Vocabulary block ``b``'s scores ``[ROWS, BLOCK]``: the biased logits (greedy) or the
    scaled logits plus Gumbel noise (sampled, the scaled logits written into ``probs_ptr``),
    and for sampled rows each row's maximum and exponential sum of its scaled logits."""
    v = b * BLOCK + tl.arange(0, BLOCK)
    vmask = v < vocab
    # The bias of the block for every request of the tile: W2's block is read once for all.
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for k0 in tl.static_range(0, RANK, K_CHUNK):
        k = k0 + tl.arange(0, K_CHUNK)
        kmask = k < RANK
        e = tl.load(
            w1_ptr + prev[:, None] * RANK + k[None, :],
            mask=row_mask[:, None] & kmask[None, :],
            other=0.0,
        )
        w = tl.load(
            w2_ptr + v[None, :].to(tl.int64) * RANK + k[:, None],
            mask=vmask[None, :] & kmask[:, None],
            other=0.0,
        )
        acc = tl.dot(e, w, acc, input_precision="ieee")
    dtype = base_ptr.dtype.element_ty
    bias = acc.to(dtype).to(tl.float32)
    mask = row_mask[:, None] & vmask[None, :]
    base = tl.load(base_ptr + rows[:, None] * base_stride + v[None, :], mask=mask, other=0.0)
    score = (base.to(tl.float32) + bias).to(dtype).to(tl.float32)
    score = tl.where(vmask[None, :], score, float("-inf"))
    block_max = tl.zeros([ROWS], tl.float32)
    block_sum = tl.zeros([ROWS], tl.float32)
    if SAMPLED:
        temperature = tl.load(temperature_ptr + rows, mask=row_mask, other=1.0)
        greedy = temperature < SAMPLING_EPS
        temperature = tl.where(greedy, 1.0, temperature)
        # vLLM divides the logits in their dtype, then takes the softmax in float32.
        scaled = (score / temperature[:, None]).to(dtype).to(tl.float32)
        scaled = tl.where(vmask[None, :], scaled, float("-inf"))
        tl.store(probs_ptr + rows[:, None] * probs_stride + v[None, :], scaled, mask=mask)
        block_max = tl.max(scaled, axis=1)
        block_sum = tl.sum(tl.exp(scaled - block_max[:, None]), axis=1)
        # Request r's noise: Philox keyed by seed + r, at offset STEP * vocab + v.
        seed = tl.load(seed_ptr) + rows[:, None] + tl.zeros([ROWS, BLOCK], tl.int64)
        u = tl.rand(seed, STEP * vocab + v[None, :] + tl.zeros([ROWS, BLOCK], tl.int32))
        gumbel = tl.where(greedy[:, None], 0.0, -tl.log(-tl.log(u)))
        score = scaled + gumbel
    return score, block_max, block_sum


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
    base_ptr,  # this position's base logits, request r's token v at r * base_stride + v
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
    num_requests,
    vocab,
    num_blocks,
    STEP: tl.constexpr,
    SAMPLED: tl.constexpr,
    RANK: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    K_CHUNK: tl.constexpr,
    REDUCE_CHUNK: tl.constexpr,
    SAMPLING_EPS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < num_requests
    b = tl.program_id(1)
    v = b * BLOCK + tl.arange(0, BLOCK)
    vmask = v < vocab
    if STEP == 0:
        prev = tl.load(anchor_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    else:
        prev = _take_previous(
            prev_score_ptr,
            prev_arg_ptr,
            drafts_ptr,
            drafts_stride,
            rows,
            row_mask,
            num_blocks,
            STEP - 1,
            ROWS,
            REDUCE_CHUNK,
        )
        if SAMPLED:
            _normalize_block(
                probs_ptr + (STEP - 1) * probs_step_stride,
                probs_stride,
                prev_max_ptr,
                prev_sum_ptr,
                rows,
                row_mask,
                v,
                vmask,
                num_blocks,
                ROWS,
                REDUCE_CHUNK,
            )
    score, block_max, block_sum = _block_scores(
        prev,
        rows,
        row_mask,
        b,
        w1_ptr,
        w2_ptr,
        base_ptr,
        base_stride,
        temperature_ptr,
        seed_ptr,
        probs_ptr + STEP * probs_step_stride,
        probs_stride,
        vocab,
        STEP,
        SAMPLED,
        RANK,
        ROWS,
        BLOCK,
        K_CHUNK,
        SAMPLING_EPS,
    )
    if SAMPLED:
        tl.store(out_max_ptr + rows * num_blocks + b, block_max, mask=row_mask)
        tl.store(out_sum_ptr + rows * num_blocks + b, block_sum, mask=row_mask)
    value, idx = tl.max(score, axis=1, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_score_ptr + rows * num_blocks + b, value, mask=row_mask)
    tl.store(out_arg_ptr + rows * num_blocks + b, (b * BLOCK + idx).to(tl.int64), mask=row_mask)


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
    num_requests,
    vocab,
    num_blocks,
    STEP: tl.constexpr,
    SAMPLED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    REDUCE_CHUNK: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < num_requests
    _take_previous(
        prev_score_ptr,
        prev_arg_ptr,
        drafts_ptr,
        drafts_stride,
        rows,
        row_mask,
        num_blocks,
        STEP,
        ROWS,
        REDUCE_CHUNK,
    )
    if SAMPLED:
        v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        _normalize_block(
            probs_ptr,
            probs_stride,
            prev_max_ptr,
            prev_sum_ptr,
            rows,
            row_mask,
            v,
            v < vocab,
            num_blocks,
            ROWS,
            REDUCE_CHUNK,
        )


@triton.jit
def _chain_kernel(
    anchor_ptr,  # [B] position 0's previous token
    drafts_ptr,  # [B, n] int64
    drafts_stride,
    w1_ptr,
    w2_ptr,
    base_ptr,  # [B, n, V] base logits, at r * base_stride + j * base_step_stride + v
    base_stride,
    base_step_stride,
    temperature_ptr,
    seed_ptr,
    probs_ptr,
    probs_stride,
    probs_step_stride,
    part_score_ptr,  # [2, B, num_shares] each share's best score of a position (two positions)
    part_arg_ptr,  # its token
    part_max_ptr,  # and, sampled, its maximum and exponential sum of the scaled logits
    part_sum_ptr,
    semaphore_ptr,  # [tiles] uint32, zero or 2**31
    num_requests,
    vocab,
    num_blocks,
    num_shares,
    NUM_POSITIONS: tl.constexpr,
    SAMPLED: tl.constexpr,
    RANK: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    K_CHUNK: tl.constexpr,
    SHARES_POW2: tl.constexpr,
    SAMPLING_EPS: tl.constexpr,
):
    """The whole chain in one cooperative launch: the programs of a tile of requests split
    the vocabulary into ``num_shares`` shares (share s takes blocks s, s + num_shares, ...);
    after each position they meet at a barrier, then each takes the position's tokens from the
    shares' best scores itself (the largest score, the smallest token among equal ones, as
    ``argmax`` takes it), and sampled rows rewrite their own blocks as the softmax."""
    tile = tl.program_id(1)
    rows = tile * ROWS + tl.arange(0, ROWS)
    row_mask = rows < num_requests
    s = tl.arange(0, SHARES_POW2)
    share_mask = row_mask[:, None] & (s < num_shares)[None, :]
    prev = tl.load(anchor_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    for step in tl.static_range(NUM_POSITIONS):
        parts = (step % 2 * num_requests + rows) * num_shares
        for share in range(tl.program_id(0), num_shares, tl.num_programs(0)):
            best = tl.full([ROWS], float("-inf"), tl.float32)
            best_token = tl.zeros([ROWS], tl.int64)
            run_max = tl.full([ROWS], float("-inf"), tl.float32)
            run_sum = tl.zeros([ROWS], tl.float32)
            for b in range(share, num_blocks, num_shares):
                score, block_max, block_sum = _block_scores(
                    prev,
                    rows,
                    row_mask,
                    b,
                    w1_ptr,
                    w2_ptr,
                    base_ptr + step * base_step_stride,
                    base_stride,
                    temperature_ptr,
                    seed_ptr,
                    probs_ptr + step * probs_step_stride,
                    probs_stride,
                    vocab,
                    step,
                    SAMPLED,
                    RANK,
                    ROWS,
                    BLOCK,
                    K_CHUNK,
                    SAMPLING_EPS,
                )
                value, idx = tl.max(
                    score, axis=1, return_indices=True, return_indices_tie_break_left=True
                )
                # A share's blocks ascend: a later block wins only with a larger score.
                better = value > best
                best_token = tl.where(better, b * BLOCK + idx, best_token)
                best = tl.where(better, value, best)
                if SAMPLED:
                    run_max, run_sum = _merge_exp_sums(run_max, run_sum, block_max, block_sum)
            tl.store(part_score_ptr + parts + share, best, mask=row_mask)
            tl.store(part_arg_ptr + parts + share, best_token, mask=row_mask)
            if SAMPLED:
                tl.store(part_max_ptr + parts + share, run_max, mask=row_mask)
                tl.store(part_sum_ptr + parts + share, run_sum, mask=row_mask)
        x_grid_barrier(semaphore_ptr + tile)
        # Read past the L1 cache: other programs wrote these.
        offsets = parts[:, None] + s[None, :]
        scores = tl.load(
            part_score_ptr + offsets, mask=share_mask, other=float("-inf"), cache_modifier=".cg"
        )
        tokens = tl.load(part_arg_ptr + offsets, mask=share_mask, other=0, cache_modifier=".cg")
        top = tl.max(scores, axis=1)
        first = tl.where(share_mask & (scores == top[:, None]), tokens, vocab)
        prev = tl.min(first, axis=1).to(tl.int64)
        if tl.program_id(0) == 0:
            tl.store(drafts_ptr + rows * drafts_stride + step, prev, mask=row_mask)
        if SAMPLED:
            maxima = tl.load(
                part_max_ptr + offsets, mask=share_mask, other=float("-inf"), cache_modifier=".cg"
            )
            sums = tl.load(part_sum_ptr + offsets, mask=share_mask, other=0.0, cache_modifier=".cg")
            total_max = tl.where(row_mask, tl.max(maxima, axis=1), 0.0)
            weights = tl.where(share_mask, tl.exp(maxima - total_max[:, None]), 0.0)
            total = tl.where(row_mask, tl.sum(sums * weights, axis=1), 1.0)
            for share in range(tl.program_id(0), num_shares, tl.num_programs(0)):
                for b in range(share, num_blocks, num_shares):
                    v = b * BLOCK + tl.arange(0, BLOCK)
                    _rewrite_as_softmax(
                        probs_ptr + step * probs_step_stride,
                        probs_stride,
                        total_max,
                        total,
                        rows,
                        row_mask,
                        v,
                        v < vocab,
                    )


def supported(w1: torch.Tensor, w2: torch.Tensor, base_logits: torch.Tensor) -> bool:
    """Whether the kernels take these weights and ``[B, n, V]`` base logits: one dtype for all
    three (the kernels round the bias and the sum to it)."""
    return (
        w1.dtype == w2.dtype == base_logits.dtype
        and w2.shape[1] == w1.shape[1]
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
    ``[B, n, V]`` from ``anchor_tokens`` ``[B]`` (any integer dtype): one launch on a device
    where ``prepare`` turned the one-launch chain on, else n + 1."""
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


@dataclass(frozen=True)
class WholeChain:
    """A device where the chain runs in one cooperative launch (``_chain_kernel``)."""

    semaphores: torch.Tensor
    """``[MAX_TILES]`` uint32, one barrier for each tile of requests."""
    resident: int
    """Programs the launch may have, all resident at once: a power of two, at most the
    device's multiprocessors (as PyTorch sizes its cooperative reductions)."""


# Tiles of requests a whole-chain launch may have (up to 32 requests each).
MAX_TILES = 1024
_whole_chains: dict[torch.device, WholeChain] = {}
_prepared: set[torch.device] = set()


def prepare(w1: torch.Tensor, w2: torch.Tensor) -> None:
    """Once per CUDA device, before the runner captures its CUDA graphs: use the one-launch
    chain there if it drafts what the per-position kernels do (``use_whole_chain``), with as
    many programs as the largest power of two of the device's multiprocessors."""
    device = w1.device
    if device.type != "cuda" or device in _prepared:
        return
    _prepared.add(device)
    multiprocessors = torch.cuda.get_device_properties(device).multi_processor_count
    use_whole_chain(device, 1 << (multiprocessors.bit_length() - 1), w1, w2)


def use_whole_chain(
    device: torch.device, resident: int, w1: torch.Tensor, w2: torch.Tensor
) -> str | None:
    """Run the one-launch chain on ``device`` with these weights against the per-position
    kernels (greedy and sampled, one tile and two; on CUDA also replayed from a CUDA graph),
    and use it from now on where they agree: None. Where they do not, or the launch fails (a
    Triton without cooperative launches, a device that refuses one), the chain keeps its
    ``n + 1`` launches and one warning says why, which is returned: the one launch is an
    optimisation, never a reason not to serve."""
    chain = WholeChain(torch.zeros(MAX_TILES, dtype=torch.uint32, device=device), resident)
    try:
        disagreement = _disagreement(chain, w1, w2)
    except Exception as error:  # whatever the launch raises, the per-position kernels stay
        disagreement = f"it failed: {type(error).__name__}: {error}"
    if disagreement:
        logger.warning(
            "DSpark: the one-launch Markov chain is off on %s (%s); each draft takes k + 1 "
            "launches of the per-position kernels.",
            device,
            disagreement,
        )
        return disagreement
    _whole_chains[device] = chain
    return None


def _disagreement(chain: WholeChain, w1: torch.Tensor, w2: torch.Tensor) -> str | None:
    """What differs between the one-launch and the per-position chain on random base logits
    at the weights' vocabulary, or None."""
    device = w1.device
    vocab = min(w1.shape[0], w2.shape[0])
    g = torch.Generator(device=device).manual_seed(0)
    for num_requests in (1, MAX_ROWS + 1):
        base = 8 * torch.randn(num_requests, 3, vocab, generator=g, device=device)
        base = base.to(w2.dtype)
        anchors = torch.randint(vocab, (num_requests,), generator=g, device=device)
        temperature = torch.rand(num_requests, generator=g, device=device) + 0.5
        temperature[::4] = 0.0
        seed = torch.randint(2**62, (1,), generator=g, device=device)
        for sampled in (False, True):
            expected = _run(base, anchors, w1, w2, sampled, temperature, seed, None)
            got = _run(base, anchors, w1, w2, sampled, temperature, seed, chain)
            if device.type == "cuda":
                got_replayed = _replayed(base, anchors, w1, w2, sampled, temperature, seed, chain)
            else:
                got_replayed = got
            for drafts, probs in (got, got_replayed):
                case = f"batch {num_requests}, {'sampled' if sampled else 'greedy'}"
                if not torch.equal(drafts, expected[0]):
                    return f"other drafts at {case}"
                if sampled and not torch.allclose(probs, expected[1], rtol=1e-4, atol=1e-6):
                    return f"other distributions at {case}"
    return None


def _run(
    base: torch.Tensor,
    anchors: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    sampled: bool,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    chain: WholeChain | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(drafts, distributions)`` of one chain: the one-launch chain, or without ``chain``
    the per-position kernels."""
    drafts = torch.empty(base.shape[:2], dtype=torch.int64, device=base.device)
    probs = torch.zeros(base.shape, dtype=torch.float32, device=base.device)
    sampling = (temperature, seed, probs) if sampled else None
    if chain is None:
        _per_position_chain(base, anchors, w1, w2, drafts, sampling)
    else:
        _whole_chain(base, anchors, w1, w2, drafts, sampling, chain)
    return drafts, probs


def _replayed(
    base: torch.Tensor,
    anchors: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    sampled: bool,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    chain: WholeChain,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-launch chain captured in a CUDA graph and replayed, as the runner's graphs do."""
    _run(base, anchors, w1, w2, sampled, temperature, seed, chain)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        drafts, probs = _run(base, anchors, w1, w2, sampled, temperature, seed, chain)
    drafts.fill_(-1)
    graph.replay()
    torch.cuda.synchronize(base.device)
    return drafts.clone(), probs.clone()


def _k_chunk(rank: int) -> int:
    return max(16, min(K_CHUNK, triton.next_power_of_2(rank)))


def rows_per_program(num_requests: int) -> int:
    """Requests one program takes: all of them up to ``MAX_ROWS``, so that W2 is read once a
    position; larger batches take several tiles, whose programs of one vocabulary block are
    launched next to each other."""
    return min(max(triton.next_power_of_2(num_requests), MIN_ROWS), MAX_ROWS)


def _chain(
    base_logits: torch.Tensor,
    anchor_tokens: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    drafts: torch.Tensor,
    sampling: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    chain = _whole_chains.get(drafts.device)
    tiles = triton.cdiv(base_logits.shape[0], rows_per_program(base_logits.shape[0]))
    if chain is not None and tiles <= min(chain.resident, MAX_TILES):
        _whole_chain(base_logits, anchor_tokens, w1, w2, drafts, sampling, chain)
    else:
        _per_position_chain(base_logits, anchor_tokens, w1, w2, drafts, sampling)


def _whole_chain(
    base_logits: torch.Tensor,
    anchor_tokens: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    drafts: torch.Tensor,
    sampling: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    chain: WholeChain,
) -> None:
    """One launch: ``chain.resident`` shares of the vocabulary a tile of requests, over as many
    programs as stay resident beside the other tiles' (one a tile under Triton's interpreter,
    which runs programs one after another)."""
    num_requests, num_positions, vocab = base_logits.shape
    rows = rows_per_program(num_requests)
    tiles = triton.cdiv(num_requests, rows)
    shares = chain.resident
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    programs = 1 if interpreted else max(1, chain.resident // tiles)
    # Each share's best score, maximum and exponential sum, for two positions.
    parts = torch.empty(3, 2, num_requests, shares, dtype=torch.float32, device=drafts.device)
    tokens = torch.empty(2, num_requests, shares, dtype=torch.int64, device=drafts.device)
    temperature, seed, probs = sampling if sampling is not None else (parts, parts, parts)
    _chain_kernel[(programs, tiles)](
        anchor_tokens,
        drafts,
        drafts.stride(0),
        w1,
        w2,
        base_logits,
        base_logits.stride(0),
        base_logits.stride(1),
        temperature,
        seed,
        probs,
        probs.stride(0),
        probs.stride(1),
        parts[0],
        tokens,
        parts[1],
        parts[2],
        chain.semaphores,
        num_requests,
        vocab,
        triton.cdiv(vocab, BLOCK),
        shares,
        NUM_POSITIONS=num_positions,
        SAMPLED=sampling is not None,
        RANK=w1.shape[1],
        ROWS=rows,
        BLOCK=BLOCK,
        K_CHUNK=_k_chunk(w1.shape[1]),
        SHARES_POW2=triton.next_power_of_2(shares),
        SAMPLING_EPS=_SAMPLING_EPS,
        launch_cooperative_grid=True,
    )


def _per_position_chain(
    base_logits: torch.Tensor,
    anchor_tokens: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    drafts: torch.Tensor,
    sampling: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    """``n + 1`` launches: one a position, one for the last position's tokens."""
    num_requests, num_positions, vocab = base_logits.shape
    num_blocks = triton.cdiv(vocab, BLOCK)
    rows = rows_per_program(num_requests)
    grid = (triton.cdiv(num_requests, rows), num_blocks)
    # Per block of each request: best score, its token, maximum and exponential sum, for two
    # positions (the one written and the one read).
    scratch = torch.empty(4, 2, num_requests, num_blocks, dtype=torch.float32, device=drafts.device)
    score, maximum, total = scratch[0], scratch[2], scratch[3]
    tokens = torch.empty(2, num_requests, num_blocks, dtype=torch.int64, device=drafts.device)
    temperature, seed, probs = sampling if sampling is not None else (scratch, scratch, scratch)
    sampled = sampling is not None
    for step in range(num_positions):
        read, write = (step + 1) % 2, step % 2
        _step_kernel[grid](
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
            num_requests,
            vocab,
            num_blocks,
            STEP=step,
            SAMPLED=sampled,
            RANK=w1.shape[1],
            ROWS=rows,
            BLOCK=BLOCK,
            K_CHUNK=_k_chunk(w1.shape[1]),
            REDUCE_CHUNK=REDUCE_CHUNK,
            SAMPLING_EPS=_SAMPLING_EPS,
        )
    last = (num_positions - 1) % 2
    _last_kernel[(grid[0], num_blocks if sampled else 1)](
        score[last],
        tokens[last],
        maximum[last],
        total[last],
        drafts,
        drafts.stride(0),
        probs[:, num_positions - 1] if sampled else probs,
        probs.stride(0),
        num_requests,
        vocab,
        num_blocks,
        STEP=num_positions - 1,
        SAMPLED=sampled,
        ROWS=rows,
        BLOCK=BLOCK,
        REDUCE_CHUNK=REDUCE_CHUNK,
    )
