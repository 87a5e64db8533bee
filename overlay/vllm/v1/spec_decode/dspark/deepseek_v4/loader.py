"""Strict loader for the DeepSeek-V4 DSpark draft stored as ``mtp.{s}.*`` in the target checkpoint.

The reference recipe skipped names it did not recognise, which silently dropped the shared
experts' w1/w3 and halved decode speed. Here every draft tensor the config implies must be present
and every ``mtp.*`` name must be understood, or start-up fails naming the tensors.

Checkpoint name -> backbone parameter (``stages.{s}.`` prefix):
- ``ffn.shared_experts.w1``/``w3`` -> rows [0, I) / [I, 2I) of ``ffn.shared_experts.gate_up_proj``;
  ``w2`` -> ``down_proj``.
- ``ffn.experts.{e}.w1``/``w3`` -> ``ffn.experts.w13_weight[e]``; ``w2`` -> ``w2_weight[e]``.
- ``ffn.gate.bias`` -> ``ffn.gate.e_score_correction_bias``.
- ``hc_{attn,ffn,head}_{fn,base,scale}`` -> ``hc_{attn,ffn,head}.{fn,base,scale}``.
- ``markov_head.*`` and ``confidence_head.*`` of the last stage are renamed for the shared heads
  of ``DSparkDraftModel``, which loads (and checks) them.

Quantised tensors are dequantised to the backbone dtype: FP8 (e4m3) weights with a ``.scale`` of
128x128 blocks (fp32 or ue8m0), and MXFP4 routed experts (packed e2m1, ue8m0 scale per 32 values).
"""

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from vllm.model_executor.layers.quantization.utils.fp8_utils import _upcast_e8m0_to_fp32
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import break_fp4_bytes

from .config import DeepSeekV4DSparkConfig, TensorParallelShard

if TYPE_CHECKING:
    from .backbone import DeepSeekV4DSparkBackbone

_HEAD_PREFIXES = ("markov_head.", "confidence_head.")
_STAGE_NAME = re.compile(r"mtp\.(\d+)\.(.+)")
_EXPERT_NAME = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")
# Packed FP4 (two e2m1 values per byte, low nibble first) with one ue8m0 scale per 32 values
# along the input dimension: the MXFP4 layout of DeepSeek-V4-Flash's routed experts.
_FP4_DTYPES = tuple(
    getattr(torch, name) for name in ("float4_e2m1fn_x2", "int8", "uint8") if hasattr(torch, name)
)
_MXFP4_GROUP = 32
_SHOWN_NAMES = 20


class DSparkCheckpointError(ValueError):
    """The checkpoint's draft tensors do not match the draft the config describes."""


@dataclass(frozen=True)
class _Destination:
    """Where a checkpoint tensor goes: ``param[index]`` after taking this rank's shard along
    ``shard_dim`` (``shard_units`` units of ``unit`` rows/columns, split evenly across ranks)."""

    param: str
    index: tuple[int | slice, ...] = ()
    shard_dim: int | None = None
    shard_units: int = 0
    unit: int = 1


def deepseek_v4_draft_weights(
    weights: Iterable[tuple[str, Tensor]], config: DeepSeekV4DSparkConfig
) -> Iterator[tuple[str, Tensor]]:
    """The draft's tensors out of the whole target checkpoint: ``mtp.*`` only, with the last
    stage's ``markov_head.*``/``confidence_head.*`` renamed to the shared heads' names."""
    last = f"mtp.{config.num_stages - 1}."
    for name, tensor in weights:
        if name.startswith(last) and name.removeprefix(last).startswith(_HEAD_PREFIXES):
            yield name.removeprefix(last), tensor
        elif name.startswith("mtp."):
            yield name, tensor


def expected_backbone_names(config: DeepSeekV4DSparkConfig) -> list[str]:
    """Every ``mtp.*`` tensor (``.scale`` companions aside) the backbone of ``config`` needs;
    the Markov and confidence heads are loaded by the draft model that owns them."""
    per_stage = [
        *(f"attn.{w}.weight" for w in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "q_norm", "kv_norm")),
        "attn.attn_sink",
        "attn_norm.weight",
        "ffn_norm.weight",
        *(f"hc_{part}_{p}" for part in ("attn", "ffn") for p in ("fn", "base", "scale")),
        "ffn.gate.weight",
        "ffn.gate.bias",
        *(f"ffn.shared_experts.{w}.weight" for w in ("w1", "w2", "w3")),
        *(
            f"ffn.experts.{e}.{w}.weight"
            for e in range(config.n_routed_experts)
            for w in ("w1", "w2", "w3")
        ),
    ]
    names = []
    for stage in range(config.num_stages):
        rest = list(per_stage)
        if stage == 0:
            rest += ["main_proj.weight", "main_norm.weight"]
        if stage == config.num_stages - 1:
            rest += ["norm.weight", *(f"hc_head_{p}" for p in ("fn", "base", "scale"))]
        names += [f"mtp.{stage}.{r}" for r in rest]
    return names


def load_backbone_weights(
    backbone: "DeepSeekV4DSparkBackbone",
    weights: Iterable[tuple[str, Tensor]],
    *,
    fp8_block: tuple[int, int] = (128, 128),
) -> set[str]:
    """Fills every backbone parameter from ``mtp.*`` tensors (as ``deepseek_v4_draft_weights``
    yields them, heads already taken out) and returns the filled parameter names. Raises
    ``DSparkCheckpointError`` naming missing or unknown tensors."""
    config = backbone.config
    draft = dict(weights)
    _check_stages(draft, config.num_stages)

    expected = expected_backbone_names(config)
    scales = {
        n for n in draft if n.endswith(".scale") and n.removesuffix(".scale") + ".weight" in draft
    }
    unknown = sorted(set(draft) - set(expected) - scales)
    if unknown:
        raise DSparkCheckpointError(
            f"{len(unknown)} unknown draft tensor(s) in the checkpoint: {_show(unknown)}. The "
            "checkpoint does not match this DeepSeek-V4 DSpark draft (wrong model or config)."
        )
    missing = [name for name in expected if name not in draft]
    if missing:
        raise DSparkCheckpointError(
            f"the checkpoint lacks {len(missing)} DeepSeek-V4 DSpark draft tensor(s): "
            f"{_show(missing)}. Use a complete DSpark checkpoint whose mtp.* stages match "
            f"dspark_target_layer_ids ({config.num_stages} stages)."
        )

    params = dict(backbone.named_parameters())
    filled: set[str] = set()
    for name in expected:
        destination = _destination(config, *_split(name), backbone.shard)
        if destination is None:
            continue  # a routed expert owned by another tensor-parallel rank
        scale = draft.get(name.removesuffix(".weight") + ".scale")
        tensor = _dequantize(name, draft[name], scale, fp8_block)
        _copy(name, tensor, params[destination.param], destination, backbone.shard)
        filled.add(destination.param)

    unfilled = sorted(set(params) - filled)
    if unfilled:  # a gap in this module's name mapping, never a user error
        raise AssertionError(f"draft parameters left unloaded: {_show(unfilled)}")
    return filled


def _check_stages(draft: dict[str, Tensor], num_stages: int) -> None:
    stages = sorted({int(m.group(1)) for m in map(_STAGE_NAME.fullmatch, draft) if m})
    if stages != list(range(len(stages))):
        raise DSparkCheckpointError(
            f"draft stages must be contiguous mtp.0..mtp.N-1, the checkpoint has "
            f"{', '.join(f'mtp.{s}' for s in stages)}"
        )
    if len(stages) > num_stages:
        raise DSparkCheckpointError(
            f"the checkpoint has {len(stages)} draft stages (mtp.0..mtp.{len(stages) - 1}) but "
            f"dspark_target_layer_ids lists {num_stages}; they must agree (one stage per tapped "
            "target layer)"
        )


def _split(name: str) -> tuple[int, str]:
    """``mtp.{s}.{rest}`` -> (s, rest), for names taken from ``expected_backbone_names``."""
    match = _STAGE_NAME.fullmatch(name)
    assert match is not None, name
    return int(match.group(1)), match.group(2)


def _dequantize(name: str, weight: Tensor, scale: Tensor | None, block: tuple[int, int]) -> Tensor:
    quantised = weight.dtype == torch.float8_e4m3fn or weight.dtype in _FP4_DTYPES
    if quantised and scale is None:
        raise DSparkCheckpointError(f"quantised tensor {name} has no companion .scale tensor")
    if not quantised:
        if scale is not None:
            raise DSparkCheckpointError(
                f"{name} has a .scale tensor but is neither FP8 nor packed FP4 ({weight.dtype})"
            )
        return weight
    if scale.dtype == torch.float8_e8m0fnu:
        scale = _upcast_e8m0_to_fp32(scale)
    scale = scale.float()
    if weight.dtype == torch.float8_e4m3fn:
        rows, cols = weight.shape
        expanded = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        return weight.float() * expanded[:rows, :cols]
    values = break_fp4_bytes(weight.view(torch.uint8), torch.float32)
    if scale.shape != (values.shape[0], values.shape[1] // _MXFP4_GROUP):
        raise DSparkCheckpointError(
            f"MXFP4 tensor {name} unpacks to {tuple(values.shape)} but its .scale has shape "
            f"{tuple(scale.shape)}; expected one scale per {_MXFP4_GROUP} values"
        )
    return values * scale.repeat_interleave(_MXFP4_GROUP, -1)


_RENAMES = {
    "ffn.gate.bias": "ffn.gate.e_score_correction_bias",
    **{
        f"hc_{part}_{p}": f"hc_{part}.{p}"
        for part in ("attn", "ffn", "head")
        for p in ("fn", "base", "scale")
    },
}


def _destination(
    config: DeepSeekV4DSparkConfig, stage: int, rest: str, shard: TensorParallelShard
) -> _Destination | None:
    """Maps one checkpoint tensor to its backbone parameter and this rank's shard of it."""
    prefix = f"stages.{stage}."
    head_dim, o_lora = config.head_dim, config.o_lora_rank
    shared = config.moe_intermediate_size * config.n_shared_experts
    local_shared = shared // shard.size
    inter = config.moe_intermediate_size
    if match := _EXPERT_NAME.fullmatch(rest):
        expert = int(match.group(1))
        start, end = shard.range(config.n_routed_experts, "n_routed_experts")
        if not start <= expert < end:
            return None
        local = expert - start
        which = match.group(2)
        if which == "w2":
            return _Destination(prefix + "ffn.experts.w2_weight", (local,))
        rows = slice(0, inter) if which == "w1" else slice(inter, 2 * inter)
        return _Destination(prefix + "ffn.experts.w13_weight", (local, rows))
    sharded = {
        "attn.wq_b.weight": _Destination(
            prefix + "attn.wq_b.weight", (), 0, config.num_attention_heads, head_dim
        ),
        "attn.attn_sink": _Destination(
            prefix + "attn.attn_sink", (), 0, config.num_attention_heads
        ),
        "attn.wo_a.weight": _Destination(
            prefix + "attn.wo_a.weight", (), 0, config.o_groups, o_lora
        ),
        "attn.wo_b.weight": _Destination(
            prefix + "attn.wo_b.weight", (), 1, config.o_groups, o_lora
        ),
        "ffn.shared_experts.w1.weight": _Destination(
            prefix + "ffn.shared_experts.gate_up_proj.weight", (slice(0, local_shared),), 0, shared
        ),
        "ffn.shared_experts.w3.weight": _Destination(
            prefix + "ffn.shared_experts.gate_up_proj.weight",
            (slice(local_shared, 2 * local_shared),),
            0,
            shared,
        ),
        "ffn.shared_experts.w2.weight": _Destination(
            prefix + "ffn.shared_experts.down_proj.weight", (), 1, shared
        ),
    }
    if rest in sharded:
        return sharded[rest]
    return _Destination(prefix + _RENAMES.get(rest, rest))


def _copy(
    name: str,
    tensor: Tensor,
    param: torch.nn.Parameter,
    destination: _Destination,
    shard: TensorParallelShard,
) -> None:
    target = param.data[destination.index]
    full_shape = list(target.shape)
    if destination.shard_dim is not None:
        full_shape[destination.shard_dim] = destination.shard_units * destination.unit
    if list(tensor.shape) != full_shape:
        raise DSparkCheckpointError(
            f"{name} has shape {tuple(tensor.shape)}, the draft expects {tuple(full_shape)} "
            "(config.json does not match the checkpoint)"
        )
    if destination.shard_dim is not None:
        start, end = shard.range(destination.shard_units, name)
        tensor = tensor.narrow(
            destination.shard_dim, start * destination.unit, (end - start) * destination.unit
        )
    target.copy_(tensor)


def _show(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN_NAMES])
    return shown if len(names) <= _SHOWN_NAMES else f"{shown}, ... ({len(names)} in all)"
