# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every start-up refusal of a DSpark configuration, its draft's config and files, in one place.

A bad value stops start-up in one line naming the field and the fix, instead of failing at the
first request or deep in a loader. ``checked_draft_spec`` (the config and file checks and
``check_speculative_fields``) runs in vLLM's front end as ``VllmConfig`` validates, before any
weight loads (``check_dspark_config``), and returns the draft's ``DSparkDraftSpec``; the loaded
draft's tensors are checked in the worker right after loading (they need the built draft).
Each field is looked up once, each check is named for what it refuses, and all but the file
checks are pure functions of config values. The DeepSeek-V4 draft's own fields are validated
by its config class (``deepseek_v4/config.py``) and its ``mtp.*`` tensors by its strict loader.
"""

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from vllm.v1.spec_decode.dspark.draft_log import append_records, start_record
from vllm.v1.spec_decode.dspark.family import draft_family
from vllm.v1.spec_decode.dspark.options import DSparkOptions
from vllm.v1.spec_decode.dspark.spec import DSparkDraftSpec

# Fields of the speculative config ---------------------------------------------------------------

RING_PROPOSER_UNSUPPORTED: Mapping[str, str] = {
    "attention_backend": "the draft attends over its own context ring, not through a vLLM "
    "attention backend",
    "kv_cache_dtype": "the draft keeps its context in a ring of the draft's dtype, not in "
    "vLLM's paged KV cache",
    "use_local_argmax_reduction": "the Markov chain corrects the full-vocabulary logits of "
    "every position, so there is no vocab-parallel argmax to reduce",
    "moe_backend": "DSpark drafts do not run vLLM's fused MoE layers",
    "max_model_len": "the draft's context ring covers the target's max_model_len",
}
"""Upstream fields the ring proposer refuses when set, with the reason."""

PAGED_PROPOSER_UNSUPPORTED: Mapping[str, str] = {
    "use_local_argmax_reduction": RING_PROPOSER_UNSUPPORTED["use_local_argmax_reduction"],
}
"""Upstream fields the paged (full-attention) proposer refuses; the rest reach its draft
through vLLM's own draft config (attention backend, KV-cache dtype, MoE backend, eager)."""

DEEPSEEK_V4_UNSUPPORTED: Mapping[str, str] = {
    "quantization": "the DeepSeek-V4 draft layers are built with the target's quantization, "
    "in which the checkpoint ships their mtp.* tensors",
}
"""Further fields refused for DeepSeek-V4 drafts (Qwen3 drafts honour ``quantization``)."""


def unsupported_fields(family: str) -> Mapping[str, str]:
    """The upstream fields the proposer of ``family`` refuses when set, with the reason."""
    if family == "deepseek_v4":
        return {**RING_PROPOSER_UNSUPPORTED, **DEEPSEEK_V4_UNSUPPORTED}
    return PAGED_PROPOSER_UNSUPPORTED


TARGET_INHERITED_FIELDS = ("quantization",)
"""Fields vLLM copies from the target when unset (``SpeculativeConfig.__post_init__``): set to
the target's own value they are no choice of the user's, and are not refused."""

OTHER_METHODS_FIELDS = (
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
)
"""Settings of the suffix proposer: refused when they differ from their default. (vLLM resets
``prompt_lookup_*`` to 0 for every other method before any proposer sees them.)"""


def check_speculative_fields(
    speculative_config,
    *,
    target_tensor_parallel_size: int,
    unsupported: Mapping[str, str],
) -> None:
    """The speculative config's fields that a DSpark proposer cannot honour, alone or together.
    (``ConfidenceScheduleConfig`` checks the ``dspark_confidence_*`` pair itself, and
    ``check_confidence_scheduling_without_async`` the scheduler once the platform settled
    async scheduling.)"""
    refuse_unsupported_fields(speculative_config, unsupported)
    refuse_other_methods_fields(speculative_config)
    check_probabilistic_drafts_sampler(speculative_config)
    check_draft_tensor_parallel_size(
        speculative_config.draft_tensor_parallel_size, target_tensor_parallel_size
    )
    check_draft_log(speculative_config.dspark_draft_log)


def refuse_unsupported_fields(speculative_config, unsupported: Mapping[str, str]) -> None:
    """Raise naming the first field of ``unsupported`` that is set (not None, False or "auto")."""
    target = getattr(speculative_config, "target_model_config", None)
    for name, why in unsupported.items():
        value = getattr(speculative_config, name, None)
        inherited = getattr(target, name, None) if name in TARGET_INHERITED_FIELDS else None
        if value not in (None, False, "auto", inherited):
            raise ValueError(
                f"speculative_config.{name}={value!r} is not supported by DSpark on vLLM's "
                f"V1 model runner: {why}. Remove {name}."
            )


def refuse_other_methods_fields(speculative_config) -> None:
    """Another method's settings, when they differ from their default."""
    defaults = {f.name: f.default for f in dataclasses.fields(speculative_config)}
    for name in OTHER_METHODS_FIELDS:
        value = getattr(speculative_config, name)
        if value != defaults[name]:
            raise ValueError(
                f"speculative_config.{name}={value!r} belongs to another speculative method "
                f"and has no effect with method='dspark'. Remove {name}."
            )


def check_probabilistic_drafts_sampler(speculative_config) -> None:
    """Probabilistic drafts with a rejection sampler other than the standard one (vLLM 0.33.0's
    FLy reads draft probabilities too; DSpark's are tested with the standard sampler only)."""
    if (
        speculative_config.draft_sample_method == "probabilistic"
        and speculative_config.rejection_sample_method != "standard"
    ):
        raise ValueError(
            "speculative_config.draft_sample_method='probabilistic' needs "
            "rejection_sample_method='standard', got "
            f"{speculative_config.rejection_sample_method!r}. Use "
            "draft_sample_method='greedy' or rejection_sample_method='standard'."
        )


def check_draft_tensor_parallel_size(draft_tp: int | None, target_tp: int) -> None:
    """A draft tensor-parallel size other than the target's."""
    if draft_tp is not None and draft_tp != target_tp:
        raise ValueError(
            f"speculative_config.draft_tensor_parallel_size={draft_tp} is not supported by "
            f"DSpark on V1: the draft shards over the target's tensor-parallel group "
            f"({target_tp}). Remove draft_tensor_parallel_size."
        )


def check_confidence_scheduling_without_async(scheduler: str, async_scheduling: bool) -> None:
    """Confidence-scheduled lengths under async scheduling, which schedules too early."""
    if scheduler != "off" and async_scheduling:
        raise ValueError(
            f"dspark_confidence_scheduler={scheduler!r} does not work with async "
            "scheduling: the next step is scheduled before this step's confidences exist, "
            "so its lengths would cut drafts they never scored. Serve with "
            "--no-async-scheduling, or set dspark_confidence_scheduler='off'."
        )


def check_draft_log(path: str | None) -> None:
    """``dspark_draft_log`` must name a file this process can append to: it is opened (and
    created) here and its start record written, so that a path that takes no write is refused
    now rather than turned off at the first step (``draft_log.py``)."""
    if path is None:
        return
    if not path:
        raise ValueError("dspark_draft_log must be a file path; remove it or name a file.")
    where = f"speculative_config.dspark_draft_log={path!r}"
    if os.path.isdir(path):
        raise ValueError(
            f"{where} is a directory. Name a file, e.g. {path.rstrip('/')}/drafts.jsonl."
        )
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{where}: its directory {parent} does not exist. Create it first.")
    try:
        append_records(path, [start_record()])
    except OSError as error:
        raise ValueError(
            f"{where} cannot be appended to ({error.strerror}). Name a writable file."
        ) from None


# The draft's config, before anything is built -----------------------------------------------------


def checked_draft_spec(vllm_config) -> DSparkDraftSpec:
    """The draft's config values and files and the speculative config's fields, checked before
    anything is built; what passes is the draft's spec."""
    speculative_config = vllm_config.speculative_config
    draft_model_config = speculative_config.draft_model_config
    config = draft_model_config.hf_config
    family = draft_family(draft_model_config)
    block_size = trained_block_size(config)
    check_draft_flags(config)
    k = speculative_config.num_speculative_tokens
    check_k_within_block(block_size, k)
    deepseek_v4 = None
    taps: Sequence[int]
    mask: int | None
    if family == "deepseek_v4":
        from vllm.v1.spec_decode.dspark.deepseek_v4.config import DeepSeekV4DSparkConfig

        deepseek_v4 = DeepSeekV4DSparkConfig.from_hf_config(config)
        taps, mask = deepseek_v4.dspark_target_layer_ids, deepseek_v4.dspark_noise_token_id
    else:
        taps, mask = check_paged_draft(vllm_config, family)
    check_safetensors_files(draft_model_config.model)
    check_speculative_fields(
        speculative_config,
        target_tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
        unsupported=unsupported_fields(family),
    )
    return DSparkDraftSpec(
        family=family,
        num_drafts=k,
        trained_block_size=block_size,
        samples_from_anchor=getattr(config, "sample_from_anchor", True),
        target_layer_ids=tuple(taps),
        mask_token_id=mask,
        options=DSparkOptions.from_config(speculative_config),  # checks the confidence pair
        deepseek_v4=deepseek_v4,
    )


def check_paged_draft(vllm_config, family: str) -> tuple[list[int], int | None]:
    """What a full-attention (Qwen3, Gemma-4) draft reads beyond its layers: its taps and
    mask token, checked."""
    draft_model_config = vllm_config.speculative_config.draft_model_config
    config = draft_model_config.hf_config
    target = vllm_config.model_config
    check_full_attention_layers(config, draft_model_config.model)
    mask = mask_token_id(config)
    check_mask_token_id(mask, target.get_vocab_size())
    taps = target_layer_ids(config)
    check_target_layer_ids(taps, target.get_total_num_hidden_layers())
    check_target_feature_width(config, target.get_hidden_size())
    if family == "gemma4":
        check_gemma4_draft(draft_model_config, target)
    return list(taps), mask


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


DRAFT_FLAGS = ("sample_from_anchor", "enable_confidence_head", "confidence_head_with_markov")
"""Draft-config switches read with ``getattr``: a string "false" would read as true."""


def check_draft_flags(config: object) -> None:
    """The block layout and confidence-head switches, when present, are booleans, and
    ``markov_rank`` a positive integer."""
    for key in DRAFT_FLAGS:
        value = getattr(config, key, None)
        if value is not None and not isinstance(value, bool):
            raise ValueError(
                f"The DSpark draft config's {key}={value!r} is not a boolean. Write true or "
                "false (JSON), as the draft was trained."
            )
    rank = getattr(config, "markov_rank", None)
    if rank is not None and (not _is_int(rank) or rank < 1):
        raise ValueError(
            f"The DSpark draft config's markov_rank={rank!r} is not a positive integer. Set it "
            "to the rank of the checkpoint's markov_head weights."
        )


def check_block_size(config: Any) -> None:
    """DeepSpec's ``block_size`` (or ``dspark_block_size``), when present, is a positive int:
    0 would read as "unset" and "4" fail as a TypeError deep in the proposer."""
    for key in ("block_size", "dspark_block_size"):
        value = getattr(config, key, None)
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(
                f"The DSpark draft config's {key}={value!r} is not a positive integer. Set it "
                "to the block size the draft was trained with (an integer, e.g. 7)."
            )


def trained_block_size(config: Any) -> int | None:
    """The block the draft was trained on (DeepSpec's ``block_size``, V4's
    ``dspark_block_size``), checked."""
    check_block_size(config)
    return getattr(config, "block_size", None) or getattr(config, "dspark_block_size", None)


def check_k_within_block(block_size: int | None, k: int) -> None:
    """k beyond the draft's trained block size: it never learned to predict that far."""
    if block_size and k > block_size:
        raise ValueError(
            f"num_speculative_tokens={k} exceeds the DSpark draft's trained block size "
            f"{block_size}: it never learned to predict that far. Use "
            f"num_speculative_tokens <= {block_size}."
        )


def _dflash_config(config: object) -> Mapping[str, Any]:
    return getattr(config, "dflash_config", None) or {}


def mask_token_id(config: object) -> Any:
    """DFlash's ``dflash_config.mask_token_id``, else DeepSpec's top-level one."""
    return _dflash_config(config).get("mask_token_id", getattr(config, "mask_token_id", None))


def target_layer_ids(config: object) -> Any:
    """DeepSpec's ``target_layer_ids``, else DFlash's ``dflash_config.target_layer_ids``."""
    return getattr(config, "target_layer_ids", None) or _dflash_config(config).get(
        "target_layer_ids"
    )


def check_full_attention_layers(config: object, name: str) -> None:
    """Sliding-window draft layers, which the paged proposer does not run."""
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise ValueError(
            f"'{name}' has sliding-window layers; "
            "the V1 DSpark proposer runs full-attention Qwen3 and Gemma-4 drafts only."
        )


def check_mask_token_id(mask: Any, target_vocab_size: int) -> None:
    """The mask token is embedded by the target's embedding, so inside its vocabulary."""
    if mask is not None and (not _is_int(mask) or not 0 <= mask < target_vocab_size):
        raise ValueError(
            f"The DSpark draft config's mask_token_id={mask!r} is not a token id of the "
            f"target's vocabulary [0, {target_vocab_size}). Set it to the draft's trained mask "
            "token (DeepSpec writes it to config.json)."
        )


def check_target_layer_ids(taps: Any, num_target_layers: int) -> None:
    """The taps: integer ids of this target's layers (-1: its embeddings), strictly increasing
    (the target hands its taps over in layer order; DeepSpec concatenates them in config order:
    the two agree only for increasing ids)."""
    if not taps:
        raise ValueError(
            "The DSpark draft config names no target layers: set target_layer_ids (DeepSpec) "
            "or dflash_config.target_layer_ids."
        )
    if not isinstance(taps, list | tuple) or not all(_is_int(layer) for layer in taps):
        raise ValueError(
            f"The DSpark draft config's target_layer_ids={taps!r} is not a list of integer "
            "layer ids. List the target layers the draft was trained on, e.g. [1, 17, 33]."
        )
    if any(not -1 <= i < num_target_layers for i in taps) or sorted(set(taps)) != list(taps):
        raise ValueError(
            f"DSpark target_layer_ids {list(taps)} must be strictly increasing and lie within "
            f"[-1, {num_target_layers - 1}] for this {num_target_layers}-layer target."
        )


def check_target_feature_width(config: object, target_hidden_size: int) -> None:
    """The width of the target features the draft combines must be the target's."""
    features = getattr(config, "target_hidden_size", None) or getattr(config, "hidden_size", None)
    if features != target_hidden_size:
        raise ValueError(
            f"The DSpark draft reads target features of width {features!r} "
            "(target_hidden_size, else hidden_size, in its config.json) but the target's "
            f"hidden size is {target_hidden_size}. Use the draft trained for this target."
        )


def check_gemma4_draft(draft_model_config, target_model_config) -> None:
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


# The draft's files -----------------------------------------------------------------------------


def check_safetensors_files(directory: str) -> None:
    """Each ``*.safetensors`` file of a local checkpoint directory must be complete (safetensors
    itself refuses a file its header does not describe exactly); a truncated download otherwise
    fails inside the loader without the file's name. Reads only the headers."""
    if not os.path.isdir(directory):
        return  # a hub id: vLLM resolves and verifies the download itself
    from safetensors import SafetensorError, safe_open

    for name in sorted(os.listdir(directory)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(directory, name)
        try:
            with safe_open(path, framework="pt"):
                pass
        except SafetensorError as error:
            raise ValueError(
                f"{path} is not a complete safetensors file ({error}). Download this file again."
            ) from None
        except OSError as error:
            raise ValueError(
                f"{path} cannot be read ({error.strerror or error}). Download this file again."
            ) from None


# The loaded draft --------------------------------------------------------------------------------


def check_draft_tensors(
    shipped: Iterable[str],
    parameters: Iterable[str],
    packed_modules: Mapping[str, Sequence[str]],
    from_target: Iterable[str] = (),
    buffers: Iterable[str] = (),
) -> None:
    """Refuse, by name, checkpoint tensors the draft has no parameter for and draft
    parameters the checkpoint does not fill (every shard of a packed one: vLLM's loader
    counts a packed parameter loaded after its first shard and exempts linear layers of
    unquantized models from its own completeness check).

    ``shipped``: the checkpoint's tensor names; ``parameters``: the draft's parameter names
    (``model.`` prefixed except ``lm_head``); ``from_target``: parameters the target supplies;
    ``buffers``: buffers a checkpoint may fill (Gemma-4's ``layer_scalar``), never required.
    """
    shipped = {name for name in shipped if "t2d" not in name}
    expected: dict[str, list[str]] = {}  # parameter -> the checkpoint tensors it reads
    for param in set(parameters) - set(from_target):
        if param.endswith("mask_embedding") or param == "draft_id_to_target_id":
            continue  # unused placeholder; d2t only with a reduced vocabulary (refused)
        name = param if param.startswith("lm_head") else param.removeprefix("model.")
        packed = next((key for key in packed_modules if key in name), None)
        shards = packed_modules[packed] if packed else ()
        expected[param] = [name.replace(packed, s) for s in shards] if packed else [name]
    known = {tensor for tensors in expected.values() for tensor in tensors}
    known.update(name.removeprefix("model.") for name in buffers)
    unknown = sorted(shipped - known - {"d2t"})
    if unknown:
        raise ValueError(
            "The DSpark checkpoint has tensors the draft has no parameter for: "
            + ", ".join(unknown)
            + ". Check that it matches the draft's config.json."
        )
    missing = sorted(
        param.removeprefix("model.")
        for param, tensors in expected.items()
        if not shipped.issuperset(tensors)
    )
    if missing:
        raise ValueError(
            "The DSpark checkpoint is missing draft weights: "
            + ", ".join(missing)
            + ". Check that it matches the draft's config.json."
        )


def check_loaded_draft(model, shipped: Iterable[str]) -> None:
    """``check_draft_tensors`` for a loaded ``Qwen3DSparkForCausalLM`` (or Gemma-4 subclass):
    an ``embed_tokens`` / ``lm_head`` it did not load comes from the target."""
    from_target = [
        name
        for name, flag in (
            ("model.embed_tokens.weight", "has_own_embed_tokens"),
            ("lm_head.weight", "has_own_lm_head"),
        )
        if not getattr(model, flag, False)
    ]
    parameters = [name for name, _ in model.named_parameters()]
    buffers = [name for name, _ in model.named_buffers()]
    check_draft_tensors(
        shipped, parameters, type(model).packed_modules_mapping, from_target, buffers
    )


def check_full_vocabulary(has_reduced_vocabulary: bool, name: str) -> None:
    """A draft over a reduced vocabulary (DFlash's ``d2t`` map)."""
    if has_reduced_vocabulary:
        raise ValueError(
            f"'{name}' drafts from a reduced vocabulary (d2t); "
            "the V1 DSpark proposer supports full-vocabulary drafts only."
        )


def check_confidence_head(scheduler: str, has_confidence_head: bool, name: str) -> None:
    """Confidence scheduling with a draft that has no confidence head."""
    if scheduler != "off" and not has_confidence_head:
        raise ValueError(
            f"dspark_confidence_scheduler={scheduler!r} needs a draft with a confidence head; "
            f"'{name}' has none (enable_confidence_head and confidence_head.* weights)."
        )
