"""The V1 DSpark proposer's settings, read from vLLM's ``SpeculativeConfig``.

Upstream's fields are honoured where they mean something for DSpark
(``draft_sample_method``, ``dspark_draft_topk``, ...) and refused at start-up,
naming the field, where a proposer cannot honour them. The proposer's own
settings are typed ``dspark_*`` fields that this project's patch adds to
``SpeculativeConfig`` (pydantic checks their types and ranges); the rules that
span several fields are checked here.
"""

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm.v1.spec_decode.dspark.draft_log import append_records, start_record
from vllm.v1.spec_decode.dspark.scheduling import ConfidenceScheduleConfig

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


def refuse_other_methods_fields(speculative_config) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(speculative_config)}
    for name in OTHER_METHODS_FIELDS:
        value = getattr(speculative_config, name)
        if value != defaults[name]:
            raise ValueError(
                f"speculative_config.{name}={value!r} belongs to another speculative method "
                f"and has no effect with method='dspark'. Remove {name}."
            )


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


@dataclass(frozen=True)
class DSparkOptions:
    probabilistic: bool = False
    """``draft_sample_method="probabilistic"``: drafts drawn from the
    Markov-corrected distribution, their probabilities passed to rejection
    sampling as V1's other proposers do."""
    draft_topk: int | None = None
    """``dspark_draft_topk``: correct only the top-k base-logit candidates."""
    draft_log: str | None = None
    """``dspark_draft_log``, debug only: append every step's drafts per request
    to this JSONL file. Costs a device-to-host copy per step."""
    scheduling: ConfidenceScheduleConfig = field(default_factory=ConfidenceScheduleConfig)
    """``dspark_confidence_*``: confidence-scheduled verification (off by default)."""

    @classmethod
    def from_config(
        cls,
        speculative_config,
        *,
        async_scheduling: bool,
        target_tensor_parallel_size: int,
        unsupported: Mapping[str, str] = RING_PROPOSER_UNSUPPORTED,
    ) -> "DSparkOptions":
        """Read and cross-check the fields; raise naming the field on conflict."""
        refuse_unsupported_fields(speculative_config, unsupported)
        refuse_other_methods_fields(speculative_config)
        if (
            speculative_config.draft_sample_method == "probabilistic"
            and speculative_config.rejection_sample_method != "standard"
        ):
            raise ValueError(
                "speculative_config.draft_sample_method='probabilistic' needs "
                "rejection_sample_method='standard' (the only one that reads draft "
                f"probabilities), got {speculative_config.rejection_sample_method!r}. "
                "Use draft_sample_method='greedy' or rejection_sample_method='standard'."
            )
        draft_tp = speculative_config.draft_tensor_parallel_size
        if draft_tp is not None and draft_tp != target_tensor_parallel_size:
            raise ValueError(
                f"speculative_config.draft_tensor_parallel_size={draft_tp} is not supported by "
                f"DSpark on V1: the draft shards over the target's tensor-parallel group "
                f"({target_tensor_parallel_size}). Remove draft_tensor_parallel_size."
            )
        scheduling = ConfidenceScheduleConfig(
            scheduler=speculative_config.dspark_confidence_scheduler,
            threshold=speculative_config.dspark_confidence_threshold,
        )
        if scheduling.needs_confidence and async_scheduling:
            raise ValueError(
                f"dspark_confidence_scheduler={scheduling.scheduler!r} does not work with async "
                "scheduling: the next step is scheduled before this step's confidences exist, "
                "so its lengths would cut drafts they never scored. Serve with "
                "--no-async-scheduling, or set dspark_confidence_scheduler='off'."
            )
        draft_log = speculative_config.dspark_draft_log
        if draft_log is not None and not draft_log:
            raise ValueError("dspark_draft_log must be a file path; remove it or name a file.")
        check_draft_log(draft_log)
        # Read from the draft's config, where upstream puts the field's value
        # (or the checkpoint's own dspark_draft_topk) after validating it.
        draft_topk = getattr(
            speculative_config.draft_model_config.hf_config, "dspark_draft_topk", None
        )
        return cls(
            probabilistic=speculative_config.draft_sample_method == "probabilistic",
            draft_topk=draft_topk,
            draft_log=draft_log,
            scheduling=scheduling,
        )


# Start-up checks of the draft's own config and files -------------------------------------------
# Each value the proposer reads is checked before anything is built, so that a bad value stops
# start-up in one line naming the field and the fix instead of failing at the first request.


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_draft_log(path: str | None) -> None:
    """``dspark_draft_log`` must name a file this process can append to: it is opened (and
    created) here and its start record written, so that a path that takes no write is refused
    now rather than turned off at the first step (``draft_log.py``)."""
    if path is None:
        return
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


def check_block_size(config: object) -> None:
    """DeepSpec's ``block_size`` (or ``dspark_block_size``), when present, is a positive int:
    0 would read as "unset" and "4" fail as a TypeError deep in the proposer."""
    for key in ("block_size", "dspark_block_size"):
        value = getattr(config, key, None)
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(
                f"The DSpark draft config's {key}={value!r} is not a positive integer. Set it "
                "to the block size the draft was trained with (an integer, e.g. 7)."
            )


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


def check_paged_draft_config(
    config: object, *, target_vocab_size: int, target_hidden_size: int
) -> None:
    """The values a full-attention (Qwen3, Gemma-4) DSpark draft reads beyond its layers: the mask
    token (embedded by the target's embedding, so inside its vocabulary), the target layers'
    ids (integers; their range is checked against the target by the proposer) and the width
    of the target features the draft combines."""
    dflash = getattr(config, "dflash_config", None) or {}
    mask = dflash.get("mask_token_id", getattr(config, "mask_token_id", None))
    if mask is not None and (not _is_int(mask) or not 0 <= mask < target_vocab_size):
        raise ValueError(
            f"The DSpark draft config's mask_token_id={mask!r} is not a token id of the "
            f"target's vocabulary [0, {target_vocab_size}). Set it to the draft's trained mask "
            "token (DeepSpec writes it to config.json)."
        )
    taps = getattr(config, "target_layer_ids", None) or dflash.get("target_layer_ids")
    if taps is not None and (
        not isinstance(taps, list | tuple) or not all(_is_int(layer) for layer in taps)
    ):
        raise ValueError(
            f"The DSpark draft config's target_layer_ids={taps!r} is not a list of integer "
            "layer ids. List the target layers the draft was trained on, e.g. [1, 17, 33]."
        )
    features = getattr(config, "target_hidden_size", None) or getattr(config, "hidden_size", None)
    if features != target_hidden_size:
        raise ValueError(
            f"The DSpark draft reads target features of width {features!r} "
            "(target_hidden_size, else hidden_size, in its config.json) but the target's "
            f"hidden size is {target_hidden_size}. Use the draft trained for this target."
        )


def check_safetensors_files(directory: str) -> None:
    """Each ``*.safetensors`` file in a local checkpoint directory must hold what its header
    promises; a truncated download otherwise fails inside the loader without the file's name.
    Reads only the headers."""
    if not os.path.isdir(directory):
        return  # a hub id: vLLM resolves and verifies the download itself
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            path = os.path.join(directory, name)
            problem = _safetensors_problem(path)
            if problem:
                raise ValueError(f"{path}: {problem}. Download this file again.")


def _safetensors_problem(path: str) -> str | None:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            header_size = int.from_bytes(prefix, "little") if len(prefix) == 8 else None
            if header_size is None or 8 + header_size > size:
                return f"truncated ({size} bytes): not even its header is complete"
            header = json.loads(handle.read(header_size))
    except OSError as error:
        return f"cannot be read ({error.strerror})"
    except (ValueError, UnicodeDecodeError):
        return "its header is not valid safetensors JSON"
    if not isinstance(header, dict):
        return "its header is not valid safetensors JSON"
    ends = [
        entry.get("data_offsets", [0, 0])[1]
        for key, entry in header.items()
        if key != "__metadata__" and isinstance(entry, dict)
    ]
    expected = 8 + header_size + max(ends, default=0)
    if size < expected:
        return f"truncated: {size} bytes, its header describes {expected}"
    return None
