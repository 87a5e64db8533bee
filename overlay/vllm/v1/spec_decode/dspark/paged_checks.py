"""Start-up checks of a full-attention (paged) DSpark draft: pure logic over its config,
its checkpoint's tensor names and the KV-cache layout, apart from the proposer."""

from collections.abc import Iterable, Mapping, Sequence


def check_paged_draft(vllm_config, family: str) -> None:
    """What the paged proposer cannot run as the draft was trained, refused by name."""
    draft_model_config = vllm_config.speculative_config.draft_model_config
    config = draft_model_config.hf_config
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise ValueError(
            f"'{draft_model_config.model}' has sliding-window layers; "
            "the V1 DSpark proposer runs full-attention Qwen3 and Gemma-4 drafts only."
        )
    check_target_layers(config, vllm_config.model_config.get_total_num_hidden_layers())
    if family == "gemma4":
        check_gemma4_draft(draft_model_config, vllm_config.model_config)


def check_target_layers(config, num_target_layers: int) -> None:
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
        shards = packed_modules[packed] if packed else [None]
        expected[param] = [name.replace(packed, shard) if packed else name for shard in shards]
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


def draft_kv_share(kv_cache_config, draft_layer_names: set[str]) -> float:
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
