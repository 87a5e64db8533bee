"""Tiny draft checkpoints for the CPU benchmarks: DFlash from DSpark, and the target's
frozen tensors the drafts share."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark_demo.tiny_models import DSparkDraftSpec, build_tokenizer, dspark_draft_config


def dflash_draft_config(spec: DSparkDraftSpec) -> dict:
    """The DSpark draft config as vLLM's DFlash reads it: no Markov head."""
    config = dspark_draft_config(spec)
    config["architectures"] = ["DFlashDraftModel"]
    config.pop("markov_rank")
    return config


def save_dflash_draft(model_dir: Path, spec: DSparkDraftSpec, weights: dict) -> Path:
    """Write a DFlash draft from DSpark-named weights, dropping `markov_head.*`."""
    from safetensors.torch import save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    kept = {k: v.contiguous() for k, v in weights.items() if not k.startswith("markov_head.")}
    (model_dir / "config.json").write_text(json.dumps(dflash_draft_config(spec), indent=2))
    save_file(kept, str(model_dir / "model.safetensors"))
    build_tokenizer(model_dir)
    return model_dir


def load_target(model_dir: Path) -> torch.nn.Module:
    """The Hugging Face target in float32, eval mode."""
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
