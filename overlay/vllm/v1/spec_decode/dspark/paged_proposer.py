"""DSpark for full-attention drafts (DeepSpec Qwen3, Gemma-4) on V1's DFlash machinery.

DSpark is DFlash plus a sequential Markov chain, so this proposer subclasses
``DFlashProposer``: the draft's context K/V lives in the paged KV cache (the
draft layers' own cache tensors, addressed by the target's block tables, sized
from vLLM's KV budget and restored by prefix-cache hits), written by upstream's
``precompute_and_store_context_kv``, and the draft network is upstream's
``Qwen3DSparkForCausalLM`` or its subclass ``Gemma4DSparkForCausalLM``. What
this class adds:

- the block layout: DeepSpec's ``[anchor, mask, ...]`` in which every slot is a
  prediction (``sample_from_anchor``, the default), or DFlash's ``1 + N``
  fill-in layout when the checkpoint sets ``sample_from_anchor: false``;
- the full trained block is always drafted, and the first k drafts verified
  (a shorter block changes the drafts: the block attends bidirectionally);
- the greedy Markov chain and the confidence head, with confidence-scheduled
  lengths handed to the runner through ``take_draft_token_lengths``; the
  Markov bias is added after the base logits' soft-cap (Gemma-4), as DeepSpec
  adds it, not passed through it;
- a strict load: a tensor the draft does not have, or a draft parameter the
  checkpoint does not fill, stops start-up naming it; a shipped
  ``embed_tokens``/``lm_head`` is shared with the target only when identical.
"""

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn
from typing_extensions import override

from vllm.compilation.backends import set_model_tag
from vllm.config import SpeculativeConfig, VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.utils import (
    get_draft_load_config,
    process_weights_after_loading,
)
from vllm.model_executor.models.gemma4_dspark import Gemma4DSparkForCausalLM
from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
from vllm.model_executor.models.utils import process_eagle_weight
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm.v1.spec_decode.dspark.block import (
    num_block_drafts,
    num_block_queries,
    samples_from_anchor,
    trained_block_size,
)
from vllm.v1.spec_decode.dspark.draft_log import append_draft_log
from vllm.v1.spec_decode.dspark.markov import draft_probs_buffer, markov_chain, position_sampler
from vllm.v1.spec_decode.dspark.options import PAGED_PROPOSER_UNSUPPORTED, DSparkOptions
from vllm.v1.spec_decode.dspark.scheduling import schedule_lengths
from vllm.v1.spec_decode.dspark_proposer import draft_family

logger = init_logger(__name__)

# Upstream's Gemma-4 draft names its layers model.layers.{i} from 0, as a
# text-only Gemma-4 target does; the prefix keeps the two sets of names apart.
_DRAFT_PREFIX = {"gemma4": "dspark"}


@contextlib.contextmanager
def _as_dflash(speculative_config: SpeculativeConfig, num_fill_in_drafts: int) -> Iterator[None]:
    """Let ``DFlashProposer.__init__`` size its query buffers for a block of
    ``1 + num_fill_in_drafts`` queries; it asserts the method is "dflash"."""
    method, k = speculative_config.method, speculative_config.num_speculative_tokens
    speculative_config.method = "dflash"
    speculative_config.num_speculative_tokens = num_fill_in_drafts
    try:
        yield
    finally:
        speculative_config.method = method
        speculative_config.num_speculative_tokens = k


class DSparkPagedProposer(DFlashProposer):
    """DSpark drafts whose layers attend to the whole context (paged draft KV)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None) -> None:
        speculative_config = vllm_config.speculative_config
        assert speculative_config is not None and speculative_config.method == "dspark"
        config = speculative_config.draft_model_config.hf_config
        k = speculative_config.num_speculative_tokens
        block_size = trained_block_size(config)
        if block_size and k > block_size:
            raise ValueError(
                f"num_speculative_tokens={k} exceeds the DSpark draft's trained block size "
                f"{block_size}: it never learned to predict that far. Use "
                f"num_speculative_tokens <= {block_size}."
            )
        if "sliding_attention" in (getattr(config, "layer_types", None) or []):
            raise ValueError(
                f"'{speculative_config.draft_model_config.model}' has sliding-window layers; "
                "the V1 DSpark proposer runs full-attention Qwen3 and Gemma-4 drafts only."
            )
        _check_target_layers(config, vllm_config.model_config.get_total_num_hidden_layers())
        self._family = draft_family(speculative_config.draft_model_config)
        if self._family == "gemma4":
            _check_gemma4_draft(speculative_config.draft_model_config, vllm_config.model_config)
        self.num_block_drafts = num_block_drafts(config, k)
        self.num_query_per_req = num_block_queries(config, k)
        # The first sampled slot is the anchor's own (DeepSpec) or the one after it.
        self._first_sampled_slot = 0 if samples_from_anchor(config) else 1
        with _as_dflash(speculative_config, self.num_query_per_req - 1):
            super().__init__(vllm_config, device, runner)
        # The base class keys DFlash's fc combine of the tapped features and its
        # single-tensor model output on the method name; both hold for DSpark.
        self.method = "dflash"
        self.num_speculative_tokens = k
        self._runner = runner
        self.options = DSparkOptions.from_config(
            speculative_config,
            async_scheduling=vllm_config.scheduler_config.async_scheduling,
            target_tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
            unsupported=PAGED_PROPOSER_UNSUPPORTED,
        )
        rows = torch.arange(self.max_batch_size, device=device) * self.num_query_per_req
        self._anchor_rows = rows
        # [max_batch, block] query rows whose hidden states are sampled.
        self._sample_rows = (
            rows[:, None]
            + self._first_sampled_slot
            + torch.arange(self.num_block_drafts, device=device)[None]
        ).to(torch.int32)
        self._draft_token_lengths: torch.Tensor | None = None
        self._draft_probs = (
            draft_probs_buffer(
                self.max_batch_size, k, vllm_config.model_config.get_vocab_size(), device
            )
            if self.options.probabilistic
            else None
        )
        if block_size and k < block_size:
            logger.info(
                "DSpark draft trained with block size %d: drafting the full block, "
                "verifying the first k=%d.",
                block_size,
                k,
            )

    # Model ------------------------------------------------------------------
    @override
    def _get_model(self) -> nn.Module:
        """Upstream's loader, plus the completeness check it skips for this
        model (its ``load_weights`` returns no loaded set)."""
        draft_vllm_config = self._create_draft_vllm_config()
        model_config = self.draft_model_config
        loader = get_model_loader(get_draft_load_config(draft_vllm_config))
        with (
            set_model_tag("eagle_head"),
            set_default_torch_dtype(model_config.dtype),
            torch.device(self.device),
        ):
            model = loader.create_model(
                vllm_config=draft_vllm_config,
                model_config=model_config,
                prefix=_DRAFT_PREFIX.get(self._family, ""),
            )
        if not isinstance(model, Qwen3DSparkForCausalLM):
            raise ValueError(
                f"'{model_config.model}' builds {type(model).__name__}, not a Qwen3 or Gemma-4 "
                "DSpark draft (architectures Qwen3DSparkModel, Gemma4DSparkModel)."
            )
        load_strictly(model, loader.get_all_weights(model_config, model))
        process_weights_after_loading(model, model_config, self.device)
        return model.eval()

    @override
    def load_model(self, target_model: nn.Module) -> None:
        super().load_model(target_model)
        model = self.model
        if model.draft_id_to_target_id is not None:
            raise ValueError(
                f"'{self.draft_model_config.model}' drafts from a reduced vocabulary (d2t); "
                "the V1 DSpark proposer supports full-vocabulary drafts only."
            )
        # DeepSpec adds the Markov bias to the soft-capped base logits; the
        # model's own bias goes through its capping logits processor.
        self._markov_logits = copy.copy(model.logits_processor)
        self._markov_logits.soft_cap = None
        if self.options.scheduling.needs_confidence and model.model.confidence_head is None:
            raise ValueError(
                f"dspark_confidence_scheduler={self.options.scheduling.scheduler!r} "
                f"needs a draft with a confidence head; '{self.draft_model_config.model}' has "
                "none (enable_confidence_head and confidence_head.* weights)."
            )

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
        """DFlash's inputs for a block of ``num_query_per_req`` queries; only
        the rows sampled differ: the first k drafts of the block."""
        k = self.num_speculative_tokens
        self.num_speculative_tokens = self.num_query_per_req - 1
        try:
            num_tokens, _, new_cad = super().set_inputs_first_pass(
                target_token_ids,
                next_token_ids,
                target_positions,
                target_hidden_states,
                token_indices_to_sample,
                cad,
                num_rejected_tokens_gpu,
            )
        finally:
            self.num_speculative_tokens = k
        rows = self._sample_rows[: cad.batch_size(), :k].reshape(-1)
        return num_tokens, rows, new_cad

    @override
    def _sample_draft_tokens(
        self, hidden_states: torch.Tensor, sampling_metadata: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The Markov chain over the block's first k base logits; with
        probabilistic drafts, their distributions go to rejection sampling."""
        k = self.num_speculative_tokens
        num_requests = hidden_states.shape[0] // k
        base_logits = self.model.compute_draft_logits(hidden_states)
        anchor_tokens = self.input_ids[self._anchor_rows[:num_requests]]
        drafts, markov_embeds, probs = markov_chain(
            base_logits.view(num_requests, k, -1),
            anchor_tokens,
            self.model.markov_embed,
            self._markov_bias,
            sample=position_sampler(
                self.options.probabilistic, sampling_metadata, self.use_fp64_gumbel
            ),
            topk=self.options.draft_topk,
            markov_bias_gathered=self.model.apply_markov_bias_gathered,
            probs_out=self._draft_probs,
        )
        if self.options.scheduling.needs_confidence:
            confidence = self.model.compute_confidence(
                hidden_states, markov_embeds.flatten(0, 1)
            ).view(num_requests, k)
            # A fresh tensor each step: the runner may still be copying the last.
            self._draft_token_lengths = schedule_lengths(confidence, self.options.scheduling, k)
        if self.options.draft_log is not None:
            self._log_drafts(anchor_tokens, drafts)
        return drafts.reshape(-1), probs

    def _markov_bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
        """``W2 · W1[previous token]``, uncapped."""
        return self.model.model.markov_head.bias(markov_embed, self._markov_logits)

    def take_draft_token_lengths(self) -> torch.Tensor | None:
        """Per-request number of drafts to verify, ``[B]`` int32, or None to
        verify all of them. Read once per step by the runner."""
        lengths, self._draft_token_lengths = self._draft_token_lengths, None
        return lengths

    def _log_drafts(self, anchor_tokens: torch.Tensor, drafts: torch.Tensor) -> None:
        """Debug log (``dspark_draft_log``): per request, the last context position
        before the block, the anchor token, the drafts and the scheduled length."""
        num_requests = drafts.shape[0]
        anchor_positions = self.positions[self._anchor_rows[:num_requests]] - 1
        req_ids = self._runner.input_batch.req_ids[:num_requests]
        append_draft_log(
            self.options.draft_log,
            req_ids,
            anchor_positions,
            anchor_tokens,
            drafts,
            self._draft_token_lengths,
        )


def _check_target_layers(config, num_target_layers: int) -> None:
    """The taps must name layers of this target (-1: its embeddings)."""
    taps = getattr(config, "target_layer_ids", None) or (
        getattr(config, "dflash_config", None) or {}
    ).get("target_layer_ids")
    if not taps:
        raise ValueError(
            "The DSpark draft config names no target layers: set target_layer_ids (DeepSpec) "
            "or dflash_config.target_layer_ids."
        )
    # The target hands its taps over in layer order; DeepSpec concatenates them
    # in config order: the two agree only for increasing ids.
    if any(not -1 <= i < num_target_layers for i in taps) or sorted(set(taps)) != list(taps):
        raise ValueError(
            f"DSpark target_layer_ids {list(taps)} must be strictly increasing and lie within "
            f"[-1, {num_target_layers - 1}] for this {num_target_layers}-layer target."
        )


def _check_gemma4_draft(draft_model_config, target_model_config) -> None:
    """What upstream's ``Gemma4DSparkForCausalLM`` cannot run as DeepSpec
    trained it, refused by name: its fused context K/V precompute projects V
    from ``k_proj`` (``attention_k_eq_v``) with one head shape for every layer,
    and its ``fc`` reads taps of the draft's own width."""
    config, name = draft_model_config.hf_config, draft_model_config.model
    if not getattr(config, "attention_k_eq_v", False):
        raise ValueError(
            f"'{name}' sets attention_k_eq_v=false; the V1 DSpark proposer runs Gemma-4 "
            "drafts whose values reuse the key projection (attention_k_eq_v: true)."
        )
    shapes = {
        (layer.head_dim, layer.num_key_value_heads)
        for layer in (config.per_layer_config[i] for i in range(config.num_hidden_layers))
    }
    if len(shapes) > 1:
        raise ValueError(
            f"'{name}' has draft layers of different head_dim/num_key_value_heads "
            f"{sorted(shapes)} (per_layer_config); the V1 DSpark proposer needs one shape."
        )
    target_hidden = target_model_config.get_hidden_size()
    if config.hidden_size != target_hidden:
        raise ValueError(
            f"'{name}' has hidden_size={config.hidden_size}, the target {target_hidden}; "
            "a Gemma-4 DSpark draft reads the target's hidden states at its own width."
        )
    num_target_layers = target_model_config.get_total_num_hidden_layers()
    trained_for = getattr(config, "num_target_layers", num_target_layers)
    if trained_for != num_target_layers:
        raise ValueError(
            f"'{name}' was trained for a {trained_for}-layer target (num_target_layers); "
            f"this target has {num_target_layers} layers."
        )


_UNFILLED = float("nan")


def load_strictly(model: Qwen3DSparkForCausalLM, weights) -> None:
    """Load ``weights`` with the model's own loader and fail, naming them, on
    draft parameters no tensor wrote. Upstream's loader already refuses
    tensors that match no parameter."""
    unfilled = {
        name: param
        for name, param in model.named_parameters()
        if param.is_floating_point() and not name.endswith("mask_embedding")
    }
    with torch.no_grad():
        for param in unfilled.values():
            param.fill_(_UNFILLED)
    if isinstance(model, Gemma4DSparkForCausalLM):
        _load_gemma4(model, weights)
    else:
        model.load_weights(weights)
    # Not shipped: shared from the target by the proposer's load_model.
    shared_from_target = {
        "model.embed_tokens.weight": not getattr(model, "has_own_embed_tokens", False),
        "lm_head.weight": not getattr(model, "has_own_lm_head", False),
    }
    present = dict(model.named_parameters())  # an absent confidence head is dropped
    missing = [
        name
        for name, param in unfilled.items()
        if name in present
        and not shared_from_target.get(name, False)
        and bool(torch.isnan(param).any())
    ]
    if missing:
        raise ValueError(
            "The DSpark checkpoint is missing draft weights: "
            + ", ".join(name.removeprefix("model.") for name in missing)
            + ". Check that it matches the draft's config.json."
        )


def _load_gemma4(model: Gemma4DSparkForCausalLM, weights) -> None:
    """Upstream's Gemma-4 loader skips tensors it has no parameter for and
    never marks a shipped embedding or head: refuse the first, mark the second
    (the base proposer then shares them with the target only when identical)."""
    names = []

    def recorded():
        for name, tensor in weights:
            names.append(name)
            process_eagle_weight(model, name)
            yield name, tensor

    loaded = model.load_weights(recorded())
    unknown = [name for name in names if _gemma4_param_name(name) not in loaded]
    if unknown:
        raise ValueError(
            "The DSpark checkpoint has tensors the Gemma-4 draft has no parameter for: "
            + ", ".join(unknown)
            + ". Check that it matches the draft's config.json."
        )


def _gemma4_param_name(name: str) -> str:
    """The parameter ``Gemma4DSparkForCausalLM.load_weights`` loads ``name`` into."""
    name = name if "lm_head" in name else "model." + name
    for shard in ("gate_proj", "up_proj"):
        if shard in name:
            return name.replace(shard, "gate_up_proj")
    return name


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
