# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Validated view of the DeepSeek-V4 checkpoint fields the DSpark draft reads.

The checkpoint's ``config.json`` is the only description of the draft, so every field is
checked once at load; a bad value fails naming the field.
Types and ranges are pydantic's, as vLLM validates its own configs; the rules that span fields
are ``_check_geometry``.
"""

import itertools
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, ValidationError, model_validator
from pydantic.dataclasses import dataclass

PositiveInt = Annotated[StrictInt, Field(gt=0)]


class DSparkConfigError(ValueError):
    """A DeepSeek-V4 DSpark config field is missing or out of range."""


@dataclass(frozen=True)
class DeepSeekV4DSparkConfig:
    """Geometry of the draft; names match the checkpoint's ``config.json``."""

    hidden_size: StrictInt
    vocab_size: StrictInt
    num_hidden_layers: StrictInt
    num_attention_heads: StrictInt
    head_dim: StrictInt
    qk_rope_head_dim: StrictInt
    q_lora_rank: StrictInt
    o_lora_rank: StrictInt
    o_groups: StrictInt
    sliding_window: PositiveInt
    rms_norm_eps: StrictFloat
    rope_theta: StrictFloat
    max_position_embeddings: StrictInt
    hc_mult: PositiveInt
    hc_sinkhorn_iters: PositiveInt
    hc_eps: StrictFloat
    n_routed_experts: StrictInt
    num_experts_per_tok: PositiveInt
    moe_intermediate_size: StrictInt
    n_shared_experts: StrictInt
    routed_scaling_factor: StrictFloat
    swiglu_limit: StrictFloat
    dspark_block_size: PositiveInt
    dspark_noise_token_id: Annotated[StrictInt, Field(ge=0)]
    dspark_target_layer_ids: Annotated[tuple[StrictInt, ...], Field(min_length=1)]
    """One draft stage per id."""
    dspark_markov_rank: Annotated[StrictInt, Field(ge=0)]
    num_hash_layers: StrictInt = 0
    enable_confidence_head: StrictBool = True
    # Fixed by this implementation; a checkpoint may restate them.
    hidden_act: Literal["silu"] = "silu"
    scoring_func: Literal["sqrtsoftplus"] = "sqrtsoftplus"
    topk_method: Literal["noaux_tc"] = "noaux_tc"
    norm_topk_prob: Literal[True] = True

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
        names = cls.__dataclass_fields__
        try:
            return cls(**{name: value for name, value in source.items() if name in names})
        except ValidationError as error:
            raise DSparkConfigError(_first_problem(error)) from None

    @model_validator(mode="after")
    def _check_geometry(self) -> "DeepSeekV4DSparkConfig":
        ids = self.dspark_target_layer_ids
        last_layer = self.num_hidden_layers - 1
        checks = [
            (
                self.dspark_noise_token_id < self.vocab_size,
                f"dspark_noise_token_id must be in [0, vocab_size={self.vocab_size}), "
                f"got {self.dspark_noise_token_id}",
            ),
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
                self.num_experts_per_tok <= self.n_routed_experts,
                f"num_experts_per_tok must be in [1, n_routed_experts={self.n_routed_experts}], "
                f"got {self.num_experts_per_tok}",
            ),
            (
                max(self.num_hidden_layers, ids[-1] + 1) >= self.num_hash_layers,
                f"the draft stages would fall inside num_hash_layers={self.num_hash_layers}, "
                "which use hash routing; this draft supports noaux_tc routing only",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self


def _first_problem(error: ValidationError) -> str:
    """pydantic's first complaint as one line naming the field."""
    problem = error.errors(include_url=False)[0]
    field = ".".join(str(part) for part in problem["loc"])
    if problem["type"] == "missing":
        return (
            f"the checkpoint config has no `{field}`; a DeepSeek-V4 DSpark checkpoint must "
            "define it in config.json"
        )
    if not field:  # a rule across fields (``_check_geometry``)
        return str(problem["ctx"]["error"])
    return f"{field} = {problem['input']!r}: {problem['msg']}"
