# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DSpark for full-attention drafts (DeepSpec Qwen3, Gemma-4) on V1's DFlash machinery.

DSpark is DFlash plus a sequential Markov chain: this proposer is ``DFlashProposer``
(patched to build a block of ``num_query_per_req`` queries and accept method ``dspark``)
with upstream's ``Qwen3DSparkForCausalLM`` / ``Gemma4DSparkForCausalLM`` and the draft's
context K/V in the paged KV cache. What it adds: DeepSpec's ``[anchor, mask, ...]`` block
in which every slot is a prediction (or DFlash's ``1 + N`` fill-in layout with
``sample_from_anchor: false``), always the full trained block (it attends
bidirectionally) with the first k drafts verified, the Markov chain (its bias added after
Gemma-4's soft-cap, as DeepSpec does), confidence-scheduled lengths, and a strict load.

On CUDA the draft forward replays upstream DFlash's piecewise graphs (attention between them
eager); the stage after it (base logits, Markov chain, confidence head) replays FULL graphs
per padded request count (``cudagraph.ChainGraphs``).
"""

import copy
import gc
from typing import cast

import torch
from torch import nn
from typing_extensions import override

from vllm.compilation.backends import set_model_tag
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.logger import init_logger
from vllm.model_executor.model_loader import DefaultModelLoader, get_model_loader
from vllm.model_executor.model_loader.utils import get_draft_load_config
from vllm.model_executor.models.utils import process_eagle_weight
from vllm.platforms import current_platform
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm.v1.spec_decode.dspark.checks import (
    check_full_vocabulary,
    check_loaded_draft,
)
from vllm.v1.spec_decode.dspark.cudagraph import ChainGraphs, draft_graph_sizes
from vllm.v1.spec_decode.dspark.markov import (
    DraftSampler,
    greedy_sample,
    markov_chain,
    plain_markov_weights,
)
from vllm.v1.spec_decode.dspark.proposer_base import DSparkProposerMixin, reads_checkpoint
from vllm.v1.spec_decode.dspark.refusal import records_refusal
from vllm.v1.spec_decode.dspark.spec import draft_spec

logger = init_logger(__name__)

# Upstream's Gemma-4 draft names its layers model.layers.{i} from 0, as a
# text-only Gemma-4 target does; the prefix keeps the two sets of names apart.
_DRAFT_PREFIX = {"gemma4": "dspark"}


class DSparkPagedProposer(DSparkProposerMixin, DFlashProposer):
    """DSpark drafts whose layers attend to the whole context (paged draft KV)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None) -> None:
        spec = draft_spec(vllm_config)
        self.num_block_drafts = spec.num_block_drafts
        # Read by DFlashProposer.__init__ to size and build the query block.
        self.num_query_per_req = spec.num_queries
        super().__init__(vllm_config, device, runner)
        self._init_dspark(spec, runner)
        rows = torch.arange(self.max_batch_size, device=device) * self.num_query_per_req
        self._anchor_rows = rows
        # [max_batch, block] query rows whose hidden states are sampled: from the
        # anchor's own slot (DeepSpec) or the one after it (fill-in layout).
        first_sampled_slot = 0 if spec.samples_from_anchor else 1
        self._sample_rows = (
            rows[:, None] + first_sampled_slot + torch.arange(self.num_block_drafts, device=device)
        ).to(torch.int32)
        self._draft_probs = self._new_draft_probs()
        self.draft_graphs: ChainGraphs | None = None
        self._chain_hidden: torch.Tensor | None = None

    # Model ------------------------------------------------------------------
    @override
    def _get_model(self) -> nn.Module:
        """Upstream's loader, with the Gemma-4 draft's layer prefix, then every tensor it
        read and every draft parameter accounted for by name (unless the load format reads
        no checkpoint, ``reads_checkpoint``). A Gemma-4 draft's shipped ``embed_tokens`` /
        ``lm_head`` are marked its own, as Qwen3's ``load_weights`` marks them, so that the
        target's are shared only when identical."""
        draft_vllm_config = self._create_draft_vllm_config()
        loader = get_model_loader(get_draft_load_config(draft_vllm_config))
        checkpoint, shipped = reads_checkpoint(loader), []
        if checkpoint:
            # A loader that reads the checkpoint's files: vLLM's DefaultModelLoader.
            loader = cast(DefaultModelLoader, loader)
            read_all_weights = loader.get_all_weights

            def named_weights(*args):
                for name, tensor in read_all_weights(*args):
                    shipped.append(name)
                    yield name, tensor

            loader.get_all_weights = named_weights  # type: ignore[method-assign]  # this load only
        with set_model_tag("eagle_head"):
            model = loader.load_model(
                vllm_config=draft_vllm_config,
                model_config=self.draft_model_config,
                prefix=_DRAFT_PREFIX.get(self.spec.family, ""),
            )
        if not checkpoint:
            return model
        if self.spec.family == "gemma4":
            for name in shipped:
                process_eagle_weight(model, name)
        check_loaded_draft(model, shipped)
        return model

    @override
    @records_refusal
    def load_model(self, target_model: nn.Module) -> None:
        super().load_model(target_model)
        # vLLM's loader drops the draft's own embed_tokens / lm_head when it shares the
        # target's (``_maybe_share_*``, as for DFlash and EAGLE); their weight loaders hold
        # them in reference cycles, so their CPU oneDNN handles would be freed by a later
        # garbage collection, perhaps inside torch.compile's FakeTensor mode, where their
        # ``__del__`` fails ("Exception ignored in: CPUDNNLGEMMHandler.__del__"). Free now.
        gc.collect()
        model = self.model
        check_full_vocabulary(
            model.draft_id_to_target_id is not None, self.draft_model_config.model
        )
        # DeepSpec adds the Markov bias to the soft-capped base logits; the
        # model's own bias goes through its capping logits processor.
        self._markov_logits = copy.copy(model.logits_processor)
        self._markov_logits.soft_cap = None
        self._markov_weights = plain_markov_weights(model.model.markov_head, self._markov_logits)
        self._check_confidence_head(model.model.confidence_head is not None)
        # The chain graphs' input, allocated before vLLM's memory profile.
        self._chain_hidden = torch.zeros(
            self.max_batch_size * self.num_speculative_tokens,
            self.hidden_size,
            dtype=self.dtype,
            device=self.device,
        )

    @override
    def initialize_cudagraph_keys(self, cudagraph_mode: CUDAGraphMode) -> None:
        """Upstream's piecewise keys for the draft forward; then the chain's FULL graphs,
        planned from the runner's final capture sizes."""
        super().initialize_cudagraph_keys(cudagraph_mode)
        self.draft_graphs = None
        sizes = draft_graph_sizes(
            self.vllm_config, cudagraph_mode, current_platform.is_cuda_alike()
        )
        if not sizes or self._chain_hidden is None:
            return
        self.draft_graphs = ChainGraphs(
            self._draft_chain,
            self._chain_hidden,
            self._anchor_tokens,
            self.vllm_config,
            sizes,
            self.num_speculative_tokens,
            sample_from_logits=self._sample_from_logits if self.options.probabilistic else None,
            draft_probs=self._draft_probs,
        )

    @override
    def dummy_run(
        self,
        num_tokens: int,
        use_cudagraphs: bool = True,
        is_graph_capturing: bool = False,
        slot_mappings: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """DFlash's dummy run; in the runner's first capture pass call (any mode), the chain's
        FULL graphs are captured too."""
        super().dummy_run(num_tokens, use_cudagraphs, is_graph_capturing, slot_mappings)
        if is_graph_capturing and self.draft_graphs is not None:
            self.draft_graphs.capture_missing(self._runner.input_batch.sampling_metadata)

    @override
    def initialize_attn_backend(
        self, kv_cache_config: KVCacheConfig, kernel_block_sizes: list[int] | None = None
    ) -> None:
        super().initialize_attn_backend(kv_cache_config, kernel_block_sizes)
        share = draft_kv_share(kv_cache_config, self._draft_attn_layer_names)
        logger.info(
            "DSpark draft context K/V: %d paged layer(s) in KV-cache group %d, %.1f%% of the "
            "%.2f GiB KV budget; block of %d drafts (%d queries), k=%d.",
            len(self._draft_attn_layer_names),
            self.kv_cache_gid,
            100 * share,
            sum(t.size for t in kv_cache_config.kv_cache_tensors) / 2**30,
            self.num_block_drafts,
            self.num_query_per_req,
            self.num_speculative_tokens,
        )

    # Draft step ---------------------------------------------------------------
    @override
    def _determine_batch_execution_and_padding(
        self, num_tokens: int, use_cudagraphs: bool = True
    ) -> tuple[CUDAGraphMode, int, torch.Tensor | None]:
        """DFlash's choice for the draft forward, kept for vLLM's spec-decode metrics."""
        mode, num_input_tokens, num_tokens_across_dp = (
            super()._determine_batch_execution_and_padding(num_tokens, use_cudagraphs)
        )
        self._draft_cudagraph_mode = mode
        return mode, num_input_tokens, num_tokens_across_dp

    @override
    def set_inputs_first_pass(
        self,
        target_token_ids: torch.Tensor,
        next_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        cad: CommonAttentionMetadata,
        num_rejected_tokens_gpu: torch.Tensor | None,
    ) -> tuple[int, torch.Tensor, CommonAttentionMetadata]:
        """DFlash's inputs for the block; only the rows sampled differ: the first k
        drafts of the block."""
        num_tokens, _, new_cad = super().set_inputs_first_pass(
            target_token_ids,
            next_token_ids,
            target_positions,
            target_hidden_states,
            token_indices_to_sample,
            cad,
            num_rejected_tokens_gpu,
        )
        rows = self._sample_rows[: cad.batch_size(), : self.num_speculative_tokens]
        return num_tokens, rows.reshape(-1), new_cad

    @override
    def _sample_draft_tokens(
        self, hidden_states: torch.Tensor, sampling_metadata: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The Markov chain over the block's first k base logits, eagerly or by replaying a
        ``ChainGraphs`` graph; with probabilistic drafts, their distributions go to rejection
        sampling."""
        k = self.num_speculative_tokens
        num_requests = hidden_states.shape[0] // k
        sample = self._position_sampler(sampling_metadata)
        sampled = sample is not greedy_sample
        graphs = self.draft_graphs
        size = None if graphs is None else graphs.padded_size(num_requests, sampled)
        if size is None:
            drafts, confidence, probs = self._draft_chain(
                hidden_states, self._anchor_tokens(num_requests), sample
            )
        else:
            assert graphs is not None
            drafts, confidence, probs = graphs.draft(
                hidden_states, size, sampling_metadata if sampled else None
            )
        if confidence is not None:
            self._schedule(confidence, k)
        if self.options.draft_log is not None:
            anchors = self.positions[self._anchor_rows[:num_requests]] - 1
            self._log_drafts(anchors, self._anchor_tokens(num_requests), drafts)
        return drafts.reshape(-1), probs

    def _anchor_tokens(self, num_requests: int) -> torch.Tensor:
        """``[num_requests]`` the anchor tokens, from DFlash's input-id buffer (inside a chain
        graph, at the replay)."""
        return self.input_ids[self._anchor_rows[:num_requests]]

    def _draft_chain(
        self,
        hidden_states: torch.Tensor,
        anchor_tokens: torch.Tensor,
        sample: DraftSampler,
        drafts_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """What runs after the draft forward: the block's base logits, the Markov chain over
        them and the confidence head (``[B, k]`` drafts, written into ``drafts_out`` when
        given, and confidences, distributions)."""
        k = self.num_speculative_tokens
        num_requests = anchor_tokens.shape[0]
        base_logits = self.model.compute_draft_logits(hidden_states)
        drafts, markov_embeds, probs = markov_chain(
            base_logits.view(num_requests, k, -1),
            anchor_tokens,
            self.model.markov_embed,
            self._markov_bias,
            sample=sample,
            topk=self.options.draft_topk,
            markov_bias_gathered=self.model.apply_markov_bias_gathered,
            probs_out=self._draft_probs,
            with_embeds=self.options.scheduling.needs_confidence,
            markov_weights=self._markov_weights,
            drafts_out=drafts_out,
        )
        confidence = None
        if self.options.scheduling.needs_confidence:
            assert markov_embeds is not None
            confidence = self.model.compute_confidence(hidden_states, markov_embeds.flatten(0, 1))
            confidence = confidence.view(num_requests, k)
        return drafts, confidence, probs

    def _markov_bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
        """``W2 · W1[previous token]``, uncapped."""
        return self.model.model.markov_head.bias(markov_embed, self._markov_logits)


def draft_kv_share(kv_cache_config: KVCacheConfig, draft_layer_names: set[str]) -> float:
    """Fraction of the KV-cache bytes held by the draft's layers."""
    total = draft = 0
    for group in kv_cache_config.kv_cache_groups:
        specs = getattr(group.kv_cache_spec, "kv_cache_specs", None)
        for name in group.layer_names:
            spec = specs[name] if specs else group.kv_cache_spec
            total += spec.page_size_bytes
            if name in draft_layer_names:
                draft += spec.page_size_bytes
    return draft / total if total else 0.0
