# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DSpark's sequential stage: the low-rank Markov chain over a drafted block.

The backbone scores every block position in one parallel pass; the Markov head
then walks the block left to right, adding ``W2 · W1[previous token]`` to each
position's logits so that each draft conditions on the one before it. This is
the only sequential part of a DSpark step and costs one rank-r product per
position.

Two options change how a position is decided, both from vLLM's speculative
config and both implemented as upstream's V2 speculator does:

- ``topk`` (``dspark_draft_topk``): the rank-r correction is computed only for
  the ``topk`` candidates with the largest base logits, picked once per block;
  every other token gets ``-inf``. When the full computation's argmax is among
  those candidates the argmax is unchanged (the candidates' corrected logits
  are the same sums); otherwise the draft differs.
- ``sample`` (``draft_sample_method="probabilistic"``): each position's token
  is drawn from its corrected distribution and the next position conditions on
  the drawn token; the distributions are returned so that rejection sampling
  can use them.

Drafts without ``topk`` whose head is the plain ``W2 · W1[token]`` product
(``markov_weights``) take the fused kernels of ``markov_kernel`` where Triton runs (CUDA): one
cooperative launch for the block, or n + 1 where the device does not run that one, instead of
about four (greedy) or ten (sampled) launches a position.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.model_executor.models.qwen3_dspark import DSparkMarkovHead
from vllm.triton_utils import HAS_TRITON

PositionSampler = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
"""Maps one position's logits ``[B, V]`` to its tokens ``[B]`` and, for
probabilistic drafts, the distribution they were drawn from ``[B, V]``."""


@dataclass(frozen=True)
class SampledDrafts:
    """Probabilistic drafts at per-request temperatures: vLLM's draft sampler at each position,
    or, where the fused kernels run, the same draw in one kernel a position."""

    temperature: torch.Tensor
    """``[>= B]`` float32; rows under vLLM's greedy threshold take the argmax."""
    position_sampler: Callable[[int], PositionSampler]
    """For ``B`` rows, vLLM's sampler of one position; called once a block, before it."""


DraftSampler = PositionSampler | SampledDrafts
"""How a chain picks its tokens: ``greedy_sample``, a sampler of each position, or
``SampledDrafts``."""

GatheredBias = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(markov_embed [B, r], logits [B, V], values [B, topk], index [B, topk])``
-> ``logits`` with the corrected candidates scattered in (upstream's
``DSparkMarkovHead.apply_bias_gathered``)."""


class MarkovDrafts(NamedTuple):
    token_ids: torch.Tensor
    """``[B, n]`` int64 drafts."""
    markov_embeds: torch.Tensor | None
    """``[B, n, r]`` Markov embedding of each position's previous token (the
    confidence head's input), or None when not asked for."""
    probs: torch.Tensor | None
    """``[B, n, V]`` float32 distributions the drafts were drawn from, or None
    for greedy drafts."""


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, None]:
    return logits.argmax(dim=-1), None


def markov_chain(
    base_logits: torch.Tensor,
    anchor_tokens: torch.Tensor,
    markov_embed: Callable[[torch.Tensor], torch.Tensor],
    markov_bias: Callable[[torch.Tensor], torch.Tensor],
    *,
    sample: DraftSampler = greedy_sample,
    topk: int | None = None,
    markov_bias_gathered: GatheredBias | None = None,
    probs_out: torch.Tensor | None = None,
    with_embeds: bool = True,
    markov_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    drafts_out: torch.Tensor | None = None,
) -> MarkovDrafts:
    """Left-to-right chain over ``base_logits`` ``[B, n, V]``.

    Position j adds the bias of the token before it (the anchor for j = 0) and lets ``sample``
    pick its token (for ``SampledDrafts``, its ``position_sampler``). With ``topk`` only the
    ``topk`` largest base logits of each position are corrected (``markov_bias_gathered``) and
    the rest of the vocabulary is excluded; ``base_logits`` is then overwritten.
    Probabilistic distributions are written position by position into
    ``probs_out`` (``[>= B, >= n, V]`` float32, the proposer's preallocated
    buffer, so the peak is one buffer, not k tensors and their stack); without
    it, into one ``[B, n, V]`` tensor allocated at the first position. ``with_embeds``: return
    the Markov embeddings (the confidence head's input). ``markov_weights``: ``(W1, W2)`` when
    ``markov_bias`` is exactly ``W2 · W1[token]`` (unquantized, unscaled, not capped), which lets
    greedy and ``SampledDrafts`` drafts take the fused kernels. ``drafts_out``: a ``[>= B, >= n]``
    int64 buffer the drafts are written into (a CUDA graph's fixed output), or None for a new
    tensor.
    """
    if topk is not None and markov_bias_gathered is None:
        raise ValueError("markov_chain with topk needs markov_bias_gathered.")
    num_requests, num_positions = base_logits.shape[:2]
    if (
        (sample is greedy_sample or isinstance(sample, SampledDrafts))
        and topk is None
        and markov_weights is not None
        and fused_kernels_run_on(base_logits)
    ):
        from vllm.v1.spec_decode.dspark import markov_kernel

        if markov_kernel.supported(*markov_weights, base_logits):
            sampled = sample if isinstance(sample, SampledDrafts) else None
            return _fused_chain(
                base_logits,
                anchor_tokens,
                markov_embed,
                markov_weights,
                with_embeds,
                sampled,
                probs_out,
                drafts_view(drafts_out, num_requests, num_positions, base_logits.device),
            )
    if isinstance(sample, SampledDrafts):
        sample = sample.position_sampler(num_requests)
    if topk is not None:
        base_values, candidates = base_logits.topk(topk, dim=-1)
        # One dense buffer for the whole block; each position scatters its
        # corrected candidates into its own row.
        base_logits.fill_(float("-inf"))
    previous = anchor_tokens.long()
    drafts, embeds = [], []
    probs: torch.Tensor | None = None
    for position in range(num_positions):
        embed = markov_embed(previous)
        if topk is None:
            logits = base_logits[:, position] + markov_bias(embed)
        else:
            assert markov_bias_gathered is not None
            logits = markov_bias_gathered(
                embed,
                base_logits[:, position],
                base_values[:, position],
                candidates[:, position],
            )
        previous, position_probs = sample(logits)
        previous = previous.long()
        drafts.append(previous)
        if with_embeds:
            embeds.append(embed)
        if position_probs is not None:
            if probs is None:
                probs = draft_probs_view(
                    probs_out, num_requests, num_positions, logits.shape[-1], position_probs
                )
            probs[:, position].copy_(position_probs)
    markov_embeds = torch.stack(embeds, dim=1) if with_embeds else None
    token_ids = drafts_view(drafts_out, num_requests, num_positions, base_logits.device)
    return MarkovDrafts(torch.stack(drafts, dim=1, out=token_ids), markov_embeds, probs)


def plain_markov_weights(
    head: DSparkMarkovHead, logits_processor: LogitsProcessor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(W1, W2)`` when ``head.bias`` through ``logits_processor`` is exactly ``W2 · W1[token]``
    (unquantized, unsharded, unscaled, uncapped): what the fused chain computes. Called once the
    draft has loaded, before the runner captures CUDA graphs: where the fused kernels run, it
    readies them on the weights' device (``markov_kernel.prepare``)."""
    w2 = head.markov_w2
    plain = (
        isinstance(w2.quant_method, UnquantizedEmbeddingMethod)
        and w2.tp_size == 1
        and w2.bias is None
        and logits_processor.scale == 1.0
        and logits_processor.soft_cap is None
        and not logits_processor.logits_as_input
    )
    if not plain:
        return None
    weights = head.markov_w1.weight, w2.weight
    if fused_kernels_run_on(w2.weight):
        from vllm.v1.spec_decode.dspark import markov_kernel

        markov_kernel.prepare(*weights)
    return weights


def fused_kernels_run_on(tensor: torch.Tensor) -> bool:
    """Whether ``markov_kernel``'s Triton kernels run where ``tensor`` lives."""
    return HAS_TRITON and tensor.is_cuda


def _fused_chain(
    base_logits: torch.Tensor,
    anchor_tokens: torch.Tensor,
    markov_embed: Callable[[torch.Tensor], torch.Tensor],
    markov_weights: tuple[torch.Tensor, torch.Tensor],
    with_embeds: bool,
    sampled: SampledDrafts | None,
    probs_out: torch.Tensor | None,
    drafts: torch.Tensor,
) -> MarkovDrafts:
    """``markov_chain``'s loop as ``markov_kernel``'s launches; the embeddings, when asked for,
    in one lookup of the anchor and the drafts before the last. Sampled drafts take their seed
    from torch's default generator, which a CUDA graph advances on every replay."""
    from vllm.v1.spec_decode.dspark import markov_kernel

    num_requests, num_positions, vocab_size = base_logits.shape
    probs = None
    if sampled is None:
        markov_kernel.greedy_markov_chain(base_logits, anchor_tokens, *markov_weights, drafts)
    else:
        probs = draft_probs_view(
            probs_out, num_requests, num_positions, vocab_size, sampled.temperature
        )
        seed = torch.randint(2**62, (1,), device=base_logits.device)
        markov_kernel.sampled_markov_chain(
            base_logits,
            anchor_tokens,
            *markov_weights,
            drafts,
            sampled.temperature[:num_requests],
            seed,
            probs,
        )
    markov_embeds = None
    if with_embeds:
        previous = torch.cat([anchor_tokens[:, None], drafts[:, :-1]], dim=1)
        markov_embeds = markov_embed(previous)
    return MarkovDrafts(drafts, markov_embeds, probs)


def draft_probs_buffer(
    max_num_requests: int, num_drafts: int, vocab_size: int, device: torch.device
) -> torch.Tensor:
    """The ``[max_num_seqs, k, V]`` float32 distributions of probabilistic drafts (rejection
    sampling reads them): one buffer for every step, allocated (and written) before vLLM's memory
    profile so that the profile counts it."""
    return torch.zeros(max_num_requests, num_drafts, vocab_size, dtype=torch.float32, device=device)


def drafts_view(
    drafts_out: torch.Tensor | None, num_requests: int, num_positions: int, device: torch.device
) -> torch.Tensor:
    """``[B, n]`` int64 target of the chain's drafts."""
    if drafts_out is None:
        return torch.empty(num_requests, num_positions, dtype=torch.int64, device=device)
    return drafts_out[:num_requests, :num_positions]


def draft_probs_view(
    probs_out: torch.Tensor | None,
    num_requests: int,
    num_positions: int,
    vocab_size: int,
    like: torch.Tensor,
) -> torch.Tensor:
    """``[B, n, V]`` float32 target of the chain's distributions (new, on ``like``'s device,
    without ``probs_out``)."""
    if probs_out is None:
        return torch.empty(
            num_requests, num_positions, vocab_size, dtype=torch.float32, device=like.device
        )
    return probs_out[:num_requests, :num_positions]
