# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Validated view of the DeepSeek-V4 checkpoint fields the DSpark draft reads.

The checkpoint's ``config.json`` is the only description of the draft, and the reference recipe
never validated it, so every field is checked once at load; a bad value fails naming the field.
"""

import itertools
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any


class DSparkConfigError(ValueError):
    """A DeepSeek-V4 DSpark config field is missing or out of range."""


@dataclass(frozen=True)
class DeepSeekV4DSparkConfig:
    """Geometry of the draft; names match the checkpoint's ``config.json``."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    routed_scaling_factor: float
    swiglu_limit: float
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    num_hash_layers: int = 0
    enable_confidence_head: bool = True

    @property
    def num_stages(self) -> int:
        return len(self.dspark_target_layer_ids)

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features fed to ``main_proj``."""
        return self.num_stages * self.hidden_size

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> "DeepSeekV4DSparkConfig":
        """Reads and validates the fields from a ``PretrainedConfig`` or a plain mapping."""
        source = dict(hf_config if isinstance(hf_config, Mapping) else vars(hf_config))
        rope_parameters = source.get("rope_parameters") or {}
        if "rope_theta" not in source and "rope_theta" in rope_parameters:
            source["rope_theta"] = rope_parameters["rope_theta"]
        values: dict[str, Any] = {}
        for field in fields(cls):
            if field.name in source:
                values[field.name] = source[field.name]
            elif field.default is MISSING:
                raise DSparkConfigError(
                    f"the checkpoint config has no `{field.name}`; a DeepSeek-V4 DSpark "
                    "checkpoint must define it in config.json"
                )
        _check_fixed_choices(source)
        ids = values["dspark_target_layer_ids"]
        if not isinstance(ids, (list, tuple)) or not all(type(i) is int for i in ids):
            raise DSparkConfigError(
                f"dspark_target_layer_ids must be a list of integers, got {ids!r}"
            )
        values["dspark_target_layer_ids"] = tuple(ids)
        _check_types(values)
        config = cls(**values)
        config._validate()
        return config

    def _validate(self) -> None:
        ids = self.dspark_target_layer_ids
        last_layer = self.num_hidden_layers - 1
        checks = [
            (
                self.dspark_block_size > 0,
                f"dspark_block_size must be > 0, got {self.dspark_block_size}",
            ),
            (
                0 <= self.dspark_noise_token_id < self.vocab_size,
                f"dspark_noise_token_id must be in [0, vocab_size={self.vocab_size}), "
                f"got {self.dspark_noise_token_id}",
            ),
            (
                self.dspark_markov_rank >= 0,
                f"dspark_markov_rank must be >= 0, got {self.dspark_markov_rank}",
            ),
            (len(ids) > 0, "dspark_target_layer_ids must not be empty (one draft stage per id)"),
            (
                all(a < b for a, b in itertools.pairwise(ids)),
                f"dspark_target_layer_ids must be strictly increasing, got {list(ids)}",
            ),
            (
                all(i == -1 or 0 <= i <= last_layer for i in ids),
                f"dspark_target_layer_ids must each be -1 (embedding output) or in "
                f"[0, {last_layer}], got {list(ids)}",
            ),
            (
                -1 not in ids,
                "dspark_target_layer_ids contains -1 (embedding output), which vLLM's DeepSeek-V4 "
                "target cannot tap (it exposes features after decoder layers only); list decoder "
                "layers only",
            ),
            (self.sliding_window > 0, f"sliding_window must be > 0, got {self.sliding_window}"),
            (
                0 < self.qk_rope_head_dim <= self.head_dim and self.qk_rope_head_dim % 2 == 0,
                f"qk_rope_head_dim must be even and in (0, head_dim={self.head_dim}], "
                f"got {self.qk_rope_head_dim}",
            ),
            (
                self.num_attention_heads % self.o_groups == 0,
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"o_groups={self.o_groups}",
            ),
            (
                0 < self.num_experts_per_tok <= self.n_routed_experts,
                f"num_experts_per_tok must be in [1, n_routed_experts={self.n_routed_experts}], "
                f"got {self.num_experts_per_tok}",
            ),
            (self.hc_mult > 0, f"hc_mult must be > 0, got {self.hc_mult}"),
            (
                self.hc_sinkhorn_iters > 0,
                f"hc_sinkhorn_iters must be > 0, got {self.hc_sinkhorn_iters}",
            ),
            (
                max(self.num_hidden_layers, ids[-1] + 1 if ids else 0) >= self.num_hash_layers,
                f"the draft stages would fall inside num_hash_layers={self.num_hash_layers}, "
                "which use hash routing; this draft supports noaux_tc routing only",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise DSparkConfigError(message)


# Fields whose value is fixed by this implementation: (name, accepted values, default when absent).
_FIXED_CHOICES: tuple[tuple[str, tuple[Any, ...], Any], ...] = (
    ("hidden_act", ("silu",), "silu"),
    ("scoring_func", ("sqrtsoftplus",), "sqrtsoftplus"),
    ("topk_method", ("noaux_tc",), "noaux_tc"),
    ("norm_topk_prob", (True,), True),
)


def _check_types(values: dict[str, Any]) -> None:
    for field in fields(DeepSeekV4DSparkConfig):
        value = values.get(field.name, field.default)
        if field.type is int and type(value) is not int:
            raise DSparkConfigError(f"{field.name} must be an integer, got {value!r}")
        if field.type is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise DSparkConfigError(f"{field.name} must be a number, got {value!r}")


def _check_fixed_choices(source: Mapping[str, Any]) -> None:
    for name, accepted, default in _FIXED_CHOICES:
        value = source.get(name, default)
        if value not in accepted:
            raise DSparkConfigError(
                f"{name} = {value!r} is not supported by the DeepSeek-V4 DSpark draft "
                f"(supported: {', '.join(map(repr, accepted))})"
            )
