# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What both V1 DSpark proposers share: their spec and options, the per-position
sampler, the confidence-scheduled lengths, the draft log and whether the draft's
weights come from its checkpoint."""

import functools

import torch

from vllm.config.compilation import CUDAGraphMode
from vllm.model_executor.model_loader import BaseModelLoader, DummyModelLoader
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.dspark.checks import check_confidence_head
from vllm.v1.spec_decode.dspark.draft_log import DraftLog
from vllm.v1.spec_decode.dspark.markov import (
    DraftSampler,
    SampledDrafts,
    draft_probs_buffer,
    greedy_sample,
)
from vllm.v1.spec_decode.dspark.scheduling import schedule_lengths
from vllm.v1.spec_decode.dspark.spec import DSparkDraftSpec


def reads_checkpoint(loader: BaseModelLoader) -> bool:
    """Whether the draft's weights come from its checkpoint, checked by name and loaded
    strictly: not under vLLM's ``load_format="dummy"`` (``DummyModelLoader`` and its
    subclasses), which reads no checkpoint and gives the draft the loader's own values (random
    ones). The one seam for building the draft without its weights: the dry start's loader
    (``tools/dry_start/engine.py``) subclasses ``DummyModelLoader`` and builds on the meta
    device, where the ring draft has no weights to process after loading either."""
    return not isinstance(loader, DummyModelLoader)


class DSparkProposerMixin:
    """Mixed in before vLLM's proposer class (``SpecDecodeBaseProposer`` supplies
    ``_sample_from_logits``, ``speculative_config``, ``max_batch_size``, ...)."""

    def _init_dspark(self, spec: DSparkDraftSpec, runner) -> None:
        self.spec = spec
        self._runner = runner
        self.options = spec.options
        self._draft_log = DraftLog(self.options.draft_log) if self.options.draft_log else None
        self._draft_token_lengths: torch.Tensor | None = None
        self._draft_cudagraph_mode: CUDAGraphMode | None = None

    def _new_draft_probs(self) -> torch.Tensor | None:
        """The probabilistic drafts' distributions buffer (None for greedy drafts)."""
        if not self.options.probabilistic:
            return None
        vocab_size = self.vllm_config.model_config.get_vocab_size()
        return draft_probs_buffer(
            self.max_batch_size, self.num_speculative_tokens, vocab_size, self.device
        )

    def take_draft_cudagraph_mode(self) -> CUDAGraphMode | None:
        """How the last draft step ran: NONE (eagerly), FULL or PIECEWISE (the CUDA graphs it
        replayed); None when no step ran since the last call. Read once per step by the runner
        for vLLM's spec-decode metrics."""
        mode, self._draft_cudagraph_mode = self._draft_cudagraph_mode, None
        return mode

    def _check_confidence_head(self, has_confidence_head: bool) -> None:
        check_confidence_head(
            self.options.scheduling.scheduler, has_confidence_head, self.draft_model_config.model
        )

    def _position_sampler(self, sampling_metadata: SamplingMetadata) -> DraftSampler:
        """vLLM's draft sampler (``_sample_from_logits``) at the batch's temperatures;
        ``greedy_sample`` itself when every row is greedy."""
        if not self.options.probabilistic or sampling_metadata.all_greedy:
            return greedy_sample
        assert sampling_metadata.temperature is not None
        sample = functools.partial(self._sample_from_logits, sampling_metadata=sampling_metadata)
        return SampledDrafts(sampling_metadata.temperature, lambda rows: sample)

    def _schedule(self, confidence: torch.Tensor, k: int) -> None:
        # A fresh tensor each step: the runner may still be copying the last.
        self._draft_token_lengths = schedule_lengths(confidence, self.options.scheduling, k)

    def take_draft_token_lengths(self) -> torch.Tensor | None:
        """Per-request number of drafts to verify, ``[B]`` int32, or None to
        verify all of them. Read once per step by the runner."""
        lengths, self._draft_token_lengths = self._draft_token_lengths, None
        return lengths

    def _log_drafts(
        self, anchors: torch.Tensor, anchor_tokens: torch.Tensor, drafts: torch.Tensor
    ) -> None:
        """Debug log (``dspark_draft_log``): per request, the last context position
        before the block, the anchor token, the drafts and the scheduled length."""
        assert self._draft_log is not None
        req_ids = self._runner.input_batch.req_ids[: drafts.shape[0]]
        self._draft_log.append(req_ids, anchors, anchor_tokens, drafts, self._draft_token_lengths)
