# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Strict loader for the DeepSeek-V4 DSpark draft stored as ``mtp.{s}.*`` in the target checkpoint.

A check around upstream's remap. Every draft tensor the config implies must be present and every
``mtp.*`` name understood, or start-up fails naming the tensors (a loader that skips
unknown names silently drops the shared experts' w1/w3). Names
then go through upstream's ``DSparkDeepseekV4ForCausalLM._remap_dspark_name`` onto a draft laid
out with upstream's names, and through upstream's per-tensor rules (stacked ``fused_wqa_wkv`` and
``gate_up_proj``, ``w2 -> down_proj``, ``gate.bias -> e_score_correction_bias``, this rank's
``attn_sink`` heads, e8m0 expert scales as bytes, ``.scale`` suffixes by ``_EXPERT_SCALE_RE``).
Those rules are restated here: upstream writes them inside a ``load_weights`` that reads NVIDIA's
MoE attributes (absent from the CPU, AMD and XPU MoE) and that changed between 0.32.0 and 0.33.0.
``wo_a`` splits by output group, the ring attention's own layout. Tensors load as shipped through
each vLLM parameter's ``weight_loader``; nothing is dequantised.

The tensors stream from the target's safetensors files (``CheckpointDraftTensors``): the names
come from the file headers, and each ``mtp.*`` tensor is read when its parameter is filled and
dropped after, so loading holds one tensor beyond the draft's parameters and never reads the
target's own tensors.
"""

import json
import re
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor, nn

from vllm.config import ModelConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.fused_moe import fused_moe_make_expert_params_mapping
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.models.deepseek_v4.nvidia.dspark import _EXPERT_SCALE_RE, DSparkDeepseekV4ForCausalLM

from .config import DeepSeekV4DSparkConfig

if TYPE_CHECKING:
    from vllm.v1.spec_decode.dspark.draft_model import DSparkRingDraft

_STAGE_NAME = re.compile(r"mtp\.(\d+)\.(.+)")
_QUANTISED = re.compile(
    r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123]|ffn\.experts\.\d+\.w[123]"
    r"|main_proj)\.weight"
)
# (checkpoint part, parameter part, shard) of the stacked linears, as upstream's load_weights.
_STACKED = (
    (".attn.wq_a.", ".attn.fused_wqa_wkv.", 0),
    (".attn.wkv.", ".attn.fused_wqa_wkv.", 1),
    (".shared_experts.w1.", ".shared_experts.gate_up_proj.", 0),
    (".shared_experts.w3.", ".shared_experts.gate_up_proj.", 1),
)
_RENAMES = ((".shared_experts.w2.", ".shared_experts.down_proj."),)
_GATE_BIAS = (".ffn.gate.bias", ".ffn.gate.e_score_correction_bias")
_SHOWN_NAMES = 20
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")


# safetensors header dtype names (https://github.com/huggingface/safetensors, format.md);
# safetensors.torch's own table has no F8_E8M0, V4-Flash's expert scales.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class DSparkCheckpointError(ValueError):
    """The checkpoint's draft tensors do not match the draft the config describes."""


class _TensorEntry(NamedTuple):
    path: Path
    start: int
    end: int
    dtype: str
    shape: tuple[int, ...]


class CheckpointDraftTensors(Mapping[str, Tensor]):
    """The ``mtp.*`` tensors of safetensors files, each read from disk when looked up.

    Only the headers are read up front. A lookup reads that tensor's bytes with a plain file read
    into a fresh tensor (no memory map, whose touched pages would stay in the process's resident
    set until the file closes), so the caller holds it alone and frees it by dropping it.
    Iteration follows the files and their byte order.

    The header is parsed here rather than through ``safetensors.safe_open``, which reads through
    a memory map and exposes no byte offsets; safetensors itself has already refused an
    incomplete file of a local checkpoint at start-up (``checks.check_safetensors_files``).
    """

    def __init__(self, files: list[str]) -> None:
        self._entries: dict[str, _TensorEntry] = {}
        for file in sorted(files):
            path = Path(file)
            with path.open("rb") as f:
                (header_size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_size))
            header.pop("__metadata__", None)
            entries = sorted(
                (info["data_offsets"][0], name, info)
                for name, info in header.items()
                if name.startswith("mtp.")
            )
            data_start = 8 + header_size
            for start, name, info in entries:
                self._entries[name] = _TensorEntry(
                    path,
                    data_start + start,
                    data_start + info["data_offsets"][1],
                    info["dtype"],
                    tuple(info["shape"]),
                )

    def __getitem__(self, name: str) -> Tensor:
        entry = self._entries[name]
        data = torch.empty(entry.end - entry.start, dtype=torch.uint8)
        with entry.path.open("rb", buffering=0) as f:
            f.seek(entry.start)
            view = memoryview(data.numpy())
            while view:
                read = f.readinto(view)
                if not read:
                    raise DSparkCheckpointError(f"{entry.path} ends inside tensor {name}")
                view = view[read:]
        return data.view(_SAFETENSORS_DTYPES[entry.dtype]).view(entry.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def checkpoint_draft_tensors(
    model_loader: BaseModelLoader, model_config: ModelConfig
) -> CheckpointDraftTensors:
    """The target checkpoint's ``mtp.*`` tensors, from the safetensors files vLLM's loader picks
    (local folder or hub cache, index-listed shards only)."""
    if not isinstance(model_loader, DefaultModelLoader):
        raise ValueError(
            f"the DeepSeek-V4 DSpark draft loads from safetensors files; load_format "
            f"{model_loader.load_config.load_format!r} gives none. Use load_format 'auto' or "
            "'safetensors'."
        )
    _, files, use_safetensors, _ = model_loader._prepare_weights(
        model_config.model,
        None,
        model_config.revision,
        fall_back_to_pt=False,
        allow_patterns_overrides=None,
    )
    if not use_safetensors:
        raise ValueError(
            f"{model_config.model} has no safetensors files: the DeepSeek-V4 DSpark draft "
            "loads only from safetensors."
        )
    return CheckpointDraftTensors(files)


def expected_draft_names(
    config: DeepSeekV4DSparkConfig, with_confidence: bool, quantised: bool = False
) -> list[str]:
    """Every ``mtp.*`` tensor the draft of ``config`` needs; with ``quantised``, also the
    ``.scale`` of every block-FP8 linear and routed expert (V4-Flash's quantised set)."""
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
    last = config.num_stages - 1
    names = []
    for stage in range(config.num_stages):
        rest = list(per_stage)
        if stage == 0:
            rest += ["main_proj.weight", "main_norm.weight"]
        if stage == last:
            rest += ["norm.weight", *(f"hc_head_{p}" for p in ("fn", "base", "scale"))]
            rest += ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight"]
            if with_confidence:
                rest.append("confidence_head.proj.weight")
        if quantised:
            rest += [
                f"{name[: -len('.weight')]}.scale" for name in rest if _QUANTISED.fullmatch(name)
            ]
        names += [f"mtp.{stage}.{r}" for r in rest]
    return names


def load_draft_weights(
    model: "DSparkRingDraft",
    config: DeepSeekV4DSparkConfig,
    weights: Mapping[str, Tensor],
    expert_dtype: str = "fp4",
) -> None:
    """Fills every draft parameter from the target checkpoint's ``mtp.*`` tensors, looking up
    one tensor at a time (``weights`` may read each from disk, see ``CheckpointDraftTensors``).

    Raises ``DSparkCheckpointError`` naming missing or unknown tensors before anything is copied.
    """
    draft = [name for name in weights if name.startswith("mtp.")]
    _check_stages(draft, config.num_stages)
    quantised = any(name.endswith(_SCALE_SUFFIXES) for name, _ in model.named_parameters())
    expected = expected_draft_names(
        config, with_confidence=model.confidence_head is not None, quantised=quantised
    )
    confidence_prefix = f"mtp.{config.num_stages - 1}.confidence_head."
    if model.confidence_head is not None and not any(
        name.startswith(confidence_prefix) for name in draft
    ):
        # The head is enabled in config.json but not shipped: run without it (as upstream does).
        model.model.confidence_head = None
        expected = expected_draft_names(config, with_confidence=False, quantised=quantised)
    names = set(draft)
    scales = {n for n in names if n.endswith(".scale") and n[: -len(".scale")] + ".weight" in names}
    unknown = sorted(names - set(expected) - scales)
    if unknown:
        raise DSparkCheckpointError(
            f"{len(unknown)} unknown draft tensor(s) in the checkpoint: {_show(unknown)}. The "
            "checkpoint does not match this DeepSeek-V4 DSpark draft (wrong model or config)."
        )
    missing = [name for name in expected if name not in names]
    if missing:
        raise DSparkCheckpointError(
            f"the checkpoint lacks {len(missing)} DeepSeek-V4 DSpark draft tensor(s): "
            f"{_show(missing)}. Use a complete DSpark checkpoint whose mtp.* stages match "
            f"dspark_target_layer_ids ({config.num_stages} stages)."
        )

    params = dict(model.named_parameters())
    loader = _ParameterLoader(model, config, params, expert_dtype)
    for name in draft:
        loader.load(name, weights[name])
    unfilled = sorted(set(params) - loader.filled)
    if unfilled:  # a gap in this module's name mapping, never a user error
        raise AssertionError(f"draft parameters left unloaded: {_show(unfilled)}")


class _ParameterLoader:
    """Routes one checkpoint tensor to the vLLM parameter (and shard) that owns it."""

    def __init__(
        self,
        model: "DSparkRingDraft",
        config: DeepSeekV4DSparkConfig,
        params: dict[str, nn.Parameter],
        expert_dtype: str,
    ) -> None:
        self.model = model
        self.params = params
        self.config = config
        self.filled: set[str] = set()
        self.expert_scale_suffix = ".weight_scale" if expert_dtype == "fp4" else ".weight_scale_inv"
        self.expert_mapping = fused_moe_make_expert_params_mapping(
            model,
            ckpt_gate_proj_name="w1",
            ckpt_down_proj_name="w2",
            ckpt_up_proj_name="w3",
            num_experts=config.n_routed_experts,
        )
        tp_size, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        heads = config.num_attention_heads // tp_size
        self.head_range = (tp_rank * heads, (tp_rank + 1) * heads)
        groups = config.o_groups // tp_size
        self.first_group, self.num_groups = tp_rank * groups, groups

    def load(self, name: str, tensor: Tensor) -> None:
        # Upstream's remap reads only ``self.model.confidence_head`` of its draft, which this
        # draft has under the same name.
        mapped = DSparkDeepseekV4ForCausalLM._remap_dspark_name(self.model, name)
        assert mapped is not None, name
        if mapped.endswith(".scale"):
            is_expert = _EXPERT_SCALE_RE.search(mapped)
            suffix = self.expert_scale_suffix if is_expert else ".weight_scale_inv"
            mapped = mapped.removesuffix(".scale") + suffix
        for old, new in _RENAMES:
            mapped = mapped.replace(old, new)
        if ".experts." in mapped:
            self._load_expert(mapped, tensor)
            return
        for part, param, shard in _STACKED:
            if part in mapped:
                self._load(mapped.replace(part, param), tensor, shard)
                return
        base, _, suffix = mapped.partition(".attn.wo_a.")
        if suffix:
            self._load_grouped(f"{base}.attn.wo_a.", f".{suffix}", tensor)
        elif mapped.endswith(".attn.attn_sink"):
            self._load(mapped, tensor[slice(*self.head_range)])
        elif mapped.endswith(_GATE_BIAS[0]):
            self._load(mapped.removesuffix(_GATE_BIAS[0]) + _GATE_BIAS[1], tensor)
        else:
            self._load(mapped, tensor)

    def _load(self, param_name: str, tensor: Tensor, shard: int | None = None) -> None:
        """Into ``param_name`` (shard ``shard`` of a stacked linear) by its own weight_loader."""
        param = self.params.get(param_name)
        if param is None:
            raise DSparkCheckpointError(
                f"draft parameter {param_name} does not exist for this checkpoint's tensor "
                "(a quantisation scale for an unquantised draft, or a config mismatch)"
            )
        weight_loader = getattr(param, "weight_loader", None)
        if weight_loader is None and param.shape != tensor.shape:
            raise DSparkCheckpointError(
                f"{param_name} expects shape {tuple(param.shape)}, the checkpoint has "
                f"{tuple(tensor.shape)} (config.json does not match the checkpoint)"
            )
        if shard is not None:
            weight_loader(param, tensor, shard)
        else:
            (weight_loader or default_weight_loader)(param, tensor)
        self.filled.add(param_name)

    def _load_grouped(self, prefix: str, suffix: str, tensor: Tensor) -> None:
        """``wo_a`` rows (and scale rows) of each local output group into its own linear."""
        rows = tensor.shape[0] // self.config.o_groups
        for local in range(self.num_groups):
            group = self.first_group + local
            self._load(f"{prefix}{local}{suffix}", tensor[group * rows : (group + 1) * rows])

    def _load_expert(self, name: str, tensor: Tensor) -> None:
        if "weight_scale" in name and tensor.dtype == torch.float8_e8m0fnu:
            tensor = tensor.view(torch.uint8)  # the MoE keeps the raw e8m0 exponents
        for param_name, weight_name, expert_id, shard_id in self.expert_mapping:
            if weight_name not in name:
                continue
            mapped = name.replace(weight_name, param_name)
            param = self.params[mapped]
            if param.weight_loader(
                param, tensor, mapped, shard_id=shard_id, expert_id=expert_id, return_success=True
            ):
                self.filled.add(mapped)
            return
        raise AssertionError(f"no fused-MoE mapping for {name}")


def _check_stages(draft: list[str], num_stages: int) -> None:
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


def _show(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN_NAMES])
    return shown if len(names) <= _SHOWN_NAMES else f"{shown}, ... ({len(names)} in all)"
