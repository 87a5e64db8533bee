# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Run in a subprocess by test_v2_lane_is_stock.py: with Model Runner V2 selected, build what
vLLM builds for a DSpark pair before it needs a device, from the vLLM tree given first on the
command line, and print it as JSON.

Built: EngineArgs -> VllmConfig (every validator), the KV-cache config and the scheduler with
its KV-cache manager (vLLM's own functions, from the page spec of the pair's layers), one
prefix-cache hit, the V2 DSpark speculator (`init_speculator`, on the CPU device), and the
imports of the V2 runner and the DSpark model modules. Then which overlay modules
(`recipe/pins.yaml`) are in `sys.modules`. The caller compares a stock tree with one that has
DSpark installed. Replaced: only `HAS_TRITON` in vLLM's config module (a GPU host has a Triton
backend; this one has none), and model classes are inspected in-process. What stops here:
the V2 runner itself (it needs CUDA)."""

import dataclasses
import importlib
import json
import sys
import traceback
from pathlib import Path

tree, project, target, draft = (Path(arg) for arg in sys.argv[1:5])
sys.path.insert(0, str(tree))

import torch  # noqa: E402
import yaml  # noqa: E402

import vllm  # noqa: E402
import vllm.config.vllm  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.models import registry  # noqa: E402

# The one device fact replaced: a GPU host's Triton has a backend (here it has none, and
# 0.32.0's config refuses V2 without it).
vllm.config.vllm.HAS_TRITON = True
# vLLM inspects model classes in a subprocess so as not to initialise CUDA; there is none
# here, and in-process saves an interpreter start per architecture.
registry._run_in_subprocess = lambda inspect: inspect()

BLOCK = 16
V2_MODULES = (
    "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.worker.gpu.spec_decode.dspark.speculator",
    "vllm.model_executor.models.qwen3_dspark",
    "vllm.model_executor.models.gemma4_dspark",
    "vllm.models.deepseek_v4.nvidia.dspark",
)


def last_line(error: BaseException) -> str:
    return traceback.format_exception_only(error)[-1].strip()


def plain(value):
    """JSON for the values that decide behaviour; objects are left out."""
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, str)) for v in value):
        return list(value)
    if hasattr(value, "name") and hasattr(value, "value"):  # an enum member
        return str(value)
    return None


def plain_vars(obj) -> dict:
    return {key: plain(value) for key, value in sorted(vars(obj).items())}


def engine_config(**speculative):
    return EngineArgs(
        model=str(target),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        block_size=BLOCK,
        enable_prefix_caching=True,
        speculative_config={"method": "dspark", "model": str(draft), **speculative},
    ).create_engine_config()


def scheduler_for(config):
    """The scheduler as the engine core builds it, for a page spec of the pair's layers."""
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.structured_output import StructuredOutputManager

    try:  # 0.33.0
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    except ImportError:  # 0.32.0
        get_global_kv_cache_groups = None
        get_kv_cache_configs = kv_cache_utils.get_kv_cache_configs

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32, dtype=torch.float32)
    specs = [{f"model.layers.{i}.self_attn.attn": spec for i in range(3)}]
    layouts = [layout.name for layout in get_supported_kv_cache_layouts([])]
    resolve_kv_cache_layout(config, [layouts], [spec])
    memory = [64 << 20]
    if get_global_kv_cache_groups is None:
        configs = get_kv_cache_configs(config, specs, memory)
    else:
        configs = get_kv_cache_configs(
            config, specs, memory, get_global_kv_cache_groups(config, specs)
        )
    kv_cache_config = kv_cache_utils.generate_scheduler_kv_cache_config(configs)
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    block_size, hash_block_size = kv_cache_utils.resolve_kv_cache_block_sizes(
        kv_cache_config, config
    )
    scheduler = config.scheduler_config.get_scheduler_cls()(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        hash_block_size=hash_block_size,
    )
    return scheduler, hash_block_size


def prefix_hit(config, scheduler, hash_block_size: int) -> int:
    """Tokens a second request with the same 40-token prompt finds in the prefix cache."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    kv_cache_utils.init_none_hash(hash_fn)
    hasher = kv_cache_utils.get_request_block_hasher(hash_block_size, hash_fn)
    prompt = list(range(5, 45))

    def request(name: str) -> Request:
        params = SamplingParams(max_tokens=4)
        return Request(name, prompt, params, None, block_hasher=hasher)

    scheduler.add_request(request("first"))
    scheduler.schedule()
    _, hit, *_ = scheduler.kv_cache_manager.get_computed_blocks(request("second"))
    return hit


report: dict = {"vllm": vllm.__version__, "vllm_file": vllm.__file__}
config = engine_config(num_speculative_tokens=3)
speculative = config.speculative_config
report["config"] = {
    "use_v2_model_runner": config.use_v2_model_runner,
    "num_lookahead_tokens": config.num_lookahead_tokens,
    "num_prefill_lookahead_tokens": config.num_prefill_lookahead_tokens,
    "uniform_decode_query_len": config.uniform_decode_query_len,
    "compute_hash": config.compute_hash(),
    "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
}
report["speculative_fields"] = {
    field.name: plain(getattr(speculative, field.name)) for field in dataclasses.fields(speculative)
}
scheduler, hash_block_size = scheduler_for(config)
report["scheduler"] = plain_vars(scheduler)
report["kv_cache_manager"] = plain_vars(scheduler.kv_cache_manager)
report["prefix_hit_tokens"] = prefix_hit(config, scheduler, hash_block_size)
report["imports"] = {}
for module in V2_MODULES:
    try:
        importlib.import_module(module)
        report["imports"][module] = "ok"
    except Exception as error:
        report["imports"][module] = last_line(error)
with set_current_vllm_config(config):
    from vllm.v1.worker.gpu.spec_decode import init_speculator

    speculator = init_speculator(config, torch.device("cpu"), None)
report["speculator"] = {
    "class": type(speculator).__name__,
    "num_query_per_req": speculator.num_query_per_req,
}
# Read before the refusals below: a refused config may import the overlay's message helpers.
overlay = yaml.safe_load((project / "recipe" / "pins.yaml").read_text())["overlay"]
modules = {path.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for path in overlay}
report["overlay_modules_imported"] = sorted(modules.intersection(sys.modules))
report["refusals"] = {}
for name, options in {
    "v1_confidence_scheduler": {
        "dspark_confidence_scheduler": "threshold",
        "dspark_confidence_threshold": 0.5,
    },
    "adaptive_verification_without_graphs": {"enable_adaptive_verification": True},
}.items():
    try:
        engine_config(num_speculative_tokens=3, **options)
        report["refusals"][name] = None
    except Exception as error:
        report["refusals"][name] = last_line(error)
print("PROBE " + json.dumps(report))
