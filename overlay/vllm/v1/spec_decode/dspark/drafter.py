# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One DSpark draft step over a flat, ragged batch, independent of vLLM.

Given the target rows of a step (prefill chunks and verified decode rows of
several requests, laid out by ``query_start_loc``), the drafter writes each
request's valid rows into that request's ring slot, then drafts one block per
request from the ring in a single backbone pass and walks it with the Markov
chain. Every tensor op here runs on the device without a host sync, so the
step can be captured in a CUDA graph around persistent buffers.
"""

from dataclasses import dataclass
from typing import Protocol

import torch

from vllm.v1.spec_decode.dspark.backbone import DSparkBackbone
from vllm.v1.spec_decode.dspark.markov import (
    DraftSampler,
    GatheredBias,
    greedy_sample,
    markov_chain,
)
from vllm.v1.spec_decode.dspark.ring import ContextRing, rows_to_requests, valid_row_mask

# The block starts right after the last valid context position a: the anchor
# token (just sampled by the target) sits at its true position a + 1 and block
# slot j predicts position a + 2 + j. This is how DeepSpec trains DSpark drafts
# and how upstream vLLM's V2 speculator places them ("sample_from_anchor").
BLOCK_START_OFFSET = 1


class DraftHeads(Protocol):
    """Token-level heads around a backbone (shared target embedding/lm_head,
    the Markov head and the optional confidence head), named as upstream's
    DSpark draft hooks."""

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def markov_embed(self, token_ids: torch.Tensor) -> torch.Tensor: ...

    def markov_bias(self, markov_embed: torch.Tensor) -> torch.Tensor: ...

    def compute_confidence(
        self, head_hidden: torch.Tensor, markov_embed: torch.Tensor
    ) -> torch.Tensor:
        """Per-position acceptance probability in [0, 1]."""
        ...


@dataclass
class DraftOutput:
    token_ids: torch.Tensor
    """``[B, k]`` int64 drafts."""
    confidence: torch.Tensor | None
    """``[B, k]`` float32 acceptance probabilities, when requested."""
    anchors: torch.Tensor
    """``[B]`` last valid context position of each request."""
    probs: torch.Tensor | None = None
    """``[B, k, V]`` distributions of probabilistic drafts (rejection sampling
    reads them); None for greedy drafts."""


class BlockDrafter:
    """Ring bookkeeping plus the block forward for one step."""

    def __init__(
        self,
        backbone: DSparkBackbone,
        heads: DraftHeads,
        ring: ContextRing,
        noise_token_id: int,
        max_position: int,
        max_num_drafts: int,
        sample_from_anchor: bool = True,
        draft_topk: int | None = None,
        markov_bias_gathered: GatheredBias | None = None,
        draft_probs: torch.Tensor | None = None,
        markov_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """``draft_topk``: correct only the top-k base logits per position
        (``dspark_draft_topk``) with ``markov_bias_gathered``. ``draft_probs``:
        the preallocated ``[max requests, k, V]`` float32 buffer probabilistic
        drafts write their distributions into. ``markov_weights``: ``(W1, W2)``
        of a plain Markov head (``plain_markov_weights``), for the fused chain."""
        self.backbone = backbone
        self.markov_weights = markov_weights
        self.draft_probs = draft_probs
        self.draft_topk = draft_topk
        self.markov_bias_gathered = markov_bias_gathered
        self.heads = heads
        self.ring = ring
        self.scratch_slot = ring.num_slots - 1
        self.noise_token_id = noise_token_id
        self.max_position = max_position
        # Fill-in checkpoints (sample_from_anchor=False) put the anchor in a
        # slot of its own and draft from the noise slots after it.
        self.sample_offset = 0 if sample_from_anchor else 1
        # Persistent block inputs, one row per possible request, so that the
        # draft step reads fixed buffers (what CUDA-graph capture needs).
        device = ring.tags.device
        max_block_length = max_num_drafts + self.sample_offset
        self._block_ids = torch.empty(
            ring.num_slots - 1, max_block_length, dtype=torch.long, device=device
        )
        self._block_positions = torch.empty_like(self._block_ids)
        self._block_offsets = torch.arange(max_block_length, device=device) + BLOCK_START_OFFSET

    def write_context(
        self,
        request_slots: torch.Tensor,
        target_features: torch.Tensor,
        positions: torch.Tensor,
        query_start_loc: torch.Tensor,
        num_rejected: torch.Tensor | None,
    ) -> torch.Tensor:
        """Store every valid target row in its request's slot and return each
        request's anchor (last valid context position), ``[B]``.

        A request's rows past ``len - num_rejected`` are verify rows of
        rejected drafts: those tokens never existed, so they write nothing and
        the entries they would overwrite keep their old, valid value.
        """
        num_rows = positions.shape[0]
        row_request = rows_to_requests(query_start_loc, num_rows)
        num_valid = query_start_loc[1:] - query_start_loc[:-1]
        if num_rejected is not None:
            num_valid = num_valid - num_rejected
        # A step always leaves at least one verified row per request.
        num_valid = num_valid.clamp(min=1)
        valid = valid_row_mask(query_start_loc, row_request, num_valid)
        # Rows past the last request (padding) map to the scratch slot.
        row_slots = torch.cat([request_slots, request_slots.new_full((1,), self.scratch_slot)])
        entries = self.backbone.context_entries(target_features, positions)
        self.ring.write(row_slots[row_request], positions, valid, entries)

        last_valid_row = query_start_loc[:-1] + num_valid - 1
        return positions[last_valid_row.clamp(max=num_rows - 1)]

    def draft(
        self,
        request_slots: torch.Tensor,
        anchors: torch.Tensor,
        anchor_tokens: torch.Tensor,
        num_drafts: int,
        with_confidence: bool = False,
        sample: DraftSampler = greedy_sample,
        drafts_out: torch.Tensor | None = None,
    ) -> DraftOutput:
        """Draft ``num_drafts`` tokens per request from its ring; ``sample``
        picks each position's token (argmax, or drawn for probabilistic drafts);
        ``drafts_out``: the ``[>= B, >= k]`` int64 buffer they are written into."""
        num_requests = request_slots.shape[0]
        block_length = num_drafts + self.sample_offset
        block_ids = self._block_ids[:num_requests, :block_length]
        block_ids.fill_(self.noise_token_id)
        block_ids[:, 0] = anchor_tokens
        block_positions = self._block_positions[:num_requests, :block_length]
        torch.add(
            anchors.unsqueeze(1), self._block_offsets[:block_length], out=block_positions
        ).clamp_(max=self.max_position)

        context, context_mask = self.ring.read(request_slots, anchors)
        context_positions = self.ring.tags[request_slots]
        logit_hidden, confidence_hidden = self.backbone.block_hidden(
            self.heads.embed_input_ids(block_ids),
            block_positions,
            context,
            context_positions,
            context_mask,
        )
        sampled = slice(self.sample_offset, block_length)
        base_logits = self.heads.compute_logits(logit_hidden[:, sampled])
        token_ids, markov_embeds, probs = markov_chain(
            base_logits,
            anchor_tokens,
            self.heads.markov_embed,
            self.heads.markov_bias,
            sample=sample,
            topk=self.draft_topk,
            markov_bias_gathered=self.markov_bias_gathered,
            probs_out=self.draft_probs,
            with_embeds=with_confidence,
            markov_weights=self.markov_weights,
            drafts_out=drafts_out,
        )
        confidence = None
        if with_confidence:
            assert markov_embeds is not None
            confidence = self.heads.compute_confidence(confidence_hidden[:, sampled], markov_embeds)
        return DraftOutput(token_ids=token_ids, confidence=confidence, anchors=anchors, probs=probs)

    def step(
        self,
        request_slots: torch.Tensor,
        target_features: torch.Tensor,
        positions: torch.Tensor,
        query_start_loc: torch.Tensor,
        num_rejected: torch.Tensor | None,
        anchor_tokens: torch.Tensor,
        num_drafts: int,
        with_confidence: bool = False,
        sample: DraftSampler = greedy_sample,
    ) -> DraftOutput:
        """Write the step's context, then draft from it."""
        anchors = self.write_context(
            request_slots, target_features, positions, query_start_loc, num_rejected
        )
        return self.draft(
            request_slots, anchors, anchor_tokens, num_drafts, with_confidence, sample
        )
