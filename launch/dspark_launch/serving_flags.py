# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Serving flags checked against vLLM's own rules for the checkpoint being served.

Runs where the serving vLLM is installed (the image, or the local venv): the launcher pipes this
file to `python3 - CONFIG_JSON SERVE_ARGS...` before any rank starts, so a flag that vLLM would
refuse after minutes of weight loading is refused in seconds. Every rule is vLLM's:
- the serve args go through vLLM's own `vllm serve` parser (its `--moe-backend` and
  `--quantization` choices) and `--kv-cache-dtype` through vLLM's `CacheConfig`;
- the checkpoint's quantisation is resolved by vLLM's `ModelConfig._verify_quantization` from
  its `config.json`, which also refuses a `--quantization` that contradicts the checkpoint;
- `--moe-backend` goes through the MoE oracle of the experts' format (`map_mxfp4_backend`,
  `map_nvfp4_backend`, `map_fp8_backend`, `map_unquantized_backend`), whose error names the
  valid choices.
Prints one JSON object: {"ok": bool, "detail": str, "quantization": ..., "experts": ...}.
Imports of the project: `dspark_common.operator_input` and `dspark_common.vllm_flags` only,
which the launcher ships with it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from dspark_common.operator_input import NotReadable, escaped, read_text
from dspark_common.vllm_flags import closest_flags

# The MoE oracle (module, function) vLLM consults for each experts' format.
ORACLES = {
    "mxfp4": ("vllm.model_executor.layers.fused_moe.oracle.mxfp4", "map_mxfp4_backend"),
    "nvfp4": ("vllm.model_executor.layers.fused_moe.oracle.nvfp4", "map_nvfp4_backend"),
    "fp8": ("vllm.model_executor.layers.fused_moe.oracle.fp8", "map_fp8_backend"),
    "unquantized": (
        "vllm.model_executor.layers.fused_moe.oracle.unquantized",
        "map_unquantized_backend",
    ),
}
# Config keys that give a model routed experts (DeepSeek, Qwen-MoE, Mixtral/gpt-oss).
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
CONFIG_MAX_BYTES = 4 << 20
"""Largest `config.json` read (published ones are a few KiB)."""


class FlagError(Exception):
    """A serving flag vLLM would refuse for this checkpoint."""


def serve_parser() -> argparse.ArgumentParser:
    """vLLM's own `vllm serve` parser, built by its `serve` subcommand as the CLI builds it, so
    wherever a vLLM version keeps the argument definitions (`vllm.entrypoints.launchers` in
    0.32.0, `vllm.entrypoints.common` in 0.33.0)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    subcommands = FlexibleArgumentParser(prog="vllm").add_subparsers()
    return ServeSubcommand().subparser_init(subcommands)


def parse_serve_args(serve_args: list[str]) -> argparse.Namespace:
    """The serve args as vLLM's own `vllm serve` parser reads them (choices included)."""
    parser = serve_parser()
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return parser.parse_args(serve_args)
    except SystemExit:
        lines = errors.getvalue().strip().splitlines()
        said = lines[-1] if lines else "refused"
        raise FlagError(f"vLLM's serve parser: {said}{closest_flags(parser, said)}") from None


def resolve_quantization(config: dict, quantization: str | None) -> str | None:
    """The quantisation method vLLM picks for this `config.json` and `--quantization`."""
    from vllm.config.model import ModelConfig
    from vllm.transformers_utils.model_arch_config_convertor import (
        ModelArchConfigConvertorBase,
    )

    hf_config = SimpleNamespace(**config)
    # vLLM's own rules, called on stand-ins of the objects they read (nothing is loaded).
    quant_cfg = ModelArchConfigConvertorBase._normalize_quantization_config(
        None,  # type: ignore[arg-type]
        hf_config,
    )
    model = SimpleNamespace(
        quantization=quantization,
        model_arch_config=SimpleNamespace(quantization_config=quant_cfg),
        hf_config=hf_config,
        allow_deprecated_quantization=False,
    )
    try:
        ModelConfig._verify_quantization(model)  # type: ignore[arg-type]
    except ValueError as e:
        raise FlagError(f"--quantization: {e}") from None
    return model.quantization


def experts_format(config: dict, quantization: str | None) -> str | None:
    """The routed experts' weight format, or None for a model without routed experts.

    DeepSeek-V4 (`deepseek_v4_fp8`, vLLM's `DeepseekV4FP8Config.get_quant_method`): the
    top-level `expert_dtype` (default "fp4") picks FP4 or FP8 experts, and FP4 experts are
    NVFP4 when `quantization_config.moe_quant_algo` says so, else MXFP4.
    """
    if not any(config.get(key) for key in EXPERT_COUNT_KEYS):
        return None
    if quantization == "deepseek_v4_fp8":
        if config.get("expert_dtype", "fp4") == "fp8":
            return "fp8"
        algo = (config.get("quantization_config") or {}).get("moe_quant_algo") or ""
        return "nvfp4" if algo.upper() == "NVFP4" else "mxfp4"
    by_method = {
        None: "unquantized",
        "fp8": "fp8",
        "modelopt": "fp8",
        "modelopt_fp4": "nvfp4",
        "mxfp4": "mxfp4",
        "gpt_oss_mxfp4": "mxfp4",
    }
    return by_method.get(quantization, f"({quantization}: not checked here)")


def check_moe_backend(backend: str, experts: str | None) -> None:
    if backend == "auto" or experts not in ORACLES:
        return
    module, function = ORACLES[experts]
    try:
        getattr(importlib.import_module(module), function)(backend)
    except ValueError as e:
        raise FlagError(
            f"--moe-backend={backend} is refused for this checkpoint's {experts.upper()} "
            f"experts by vLLM's {function}: {e}"
        ) from None


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """vLLM's own rule for `--kv-cache-dtype`: its `CacheConfig` field (0.33.0 checks the value
    there, where platform backends may register more; 0.32.0's parser already refused it)."""
    from pydantic import ValidationError

    from vllm.config.cache import CacheConfig

    try:
        CacheConfig(cache_dtype=kv_cache_dtype)
    except ValidationError as e:
        raise FlagError(f"--kv-cache-dtype: {e.errors()[0]['msg']}") from None


def check(config: dict, serve_args: list[str]) -> dict:
    args = parse_serve_args(serve_args)
    check_kv_cache_dtype(args.kv_cache_dtype)
    quantization = resolve_quantization(config, args.quantization)
    experts = experts_format(config, quantization)
    check_moe_backend(args.moe_backend, experts)
    return {
        "ok": True,
        "detail": (
            f"quantization {quantization or 'none'}, experts {experts or 'none'}, "
            f"--moe-backend={args.moe_backend}, --kv-cache-dtype={args.kv_cache_dtype}: "
            "accepted by vLLM"
        ),
        "quantization": quantization,
        "experts": experts,
    }


def main(argv: list[str]) -> int:
    config_path, serve_args = Path(argv[0]), argv[1:]
    try:
        config = json.loads(read_text(config_path, CONFIG_MAX_BYTES)[0])
        # vLLM logs to stdout; the launcher reads only this script's JSON there.
        with contextlib.redirect_stdout(sys.stderr):
            result = check(config, serve_args)
    except (NotReadable, json.JSONDecodeError) as e:
        detail = f"cannot read the checkpoint's config.json: {escaped(str(e))}"
        result = {"ok": False, "detail": detail}
    except FlagError as e:
        result = {"ok": False, "detail": str(e)}
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
