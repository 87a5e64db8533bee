# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Run in a subprocess by test_lanes_against_vllm.py, with Model Runner V2 selected: parse the
V2 lane's rendered `vllm serve` arguments with vLLM's own parser and build `VllmConfig` from
them through `EngineArgs`; then run vLLM's rule for adaptive verification in DeepSeek-V4's
indexer at each compute capability. Prints JSON.

Arguments: the vLLM tree, a JSON file with the head's serve arguments (the model replaced by a
local directory holding the checkpoint's config.json), and the capabilities to ask about.
Replaced: `HAS_TRITON` in vLLM's config module (this CPU has no Triton backend), the platform
that the indexer asks for the device capability, and `has_deep_gemm` (answered yes, as on an
image with DeepGEMM); model classes are inspected in-process."""

import json
import sys
import traceback
from pathlib import Path

tree, args_file, *capabilities = sys.argv[1:]
sys.path.insert(0, tree)
REPO = Path(__file__).resolve().parents[2]
sys.path[1:1] = [str(REPO / "launch"), str(REPO)]  # dspark_launch, and the dspark_common it uses

import vllm.config.vllm  # noqa: E402
from dspark_launch.serving_flags import serve_parser  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.models import registry  # noqa: E402
from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum  # noqa: E402
from vllm.v1.attention.backends.mla import indexer  # noqa: E402

vllm.config.vllm.HAS_TRITON = True
registry._run_in_subprocess = lambda inspect: inspect()


report: dict = {"vllm": vllm.__version__}
args = json.loads(Path(args_file).read_text())
namespace = serve_parser().parse_args(args)
namespace.model = namespace.model_tag  # as `vllm serve MODEL` does
report["parsed_speculative_config"] = namespace.speculative_config
try:
    config = EngineArgs.from_cli_args(namespace).create_engine_config()
    speculative = config.speculative_config
    report["config"] = {
        "use_v2_model_runner": config.use_v2_model_runner,
        "method": speculative.method,
        "num_speculative_tokens": speculative.num_speculative_tokens,
        "draft_sample_method": speculative.draft_sample_method,
        "enable_adaptive_verification": speculative.enable_adaptive_verification,
        "num_lookahead_tokens": config.num_lookahead_tokens,
        "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
        "max_model_len": config.model_config.max_model_len,
        "kv_cache_dtype": config.cache_config.cache_dtype,
    }
except Exception as error:
    report["config_error"] = traceback.format_exception_only(error)[-1].strip()


class Target(Platform):
    """A CUDA device of one compute capability, for the functions that ask for it."""

    _enum = PlatformEnum.CUDA
    device_type = "cuda"
    capability: DeviceCapability | None = None

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability | None:
        return cls.capability


indexer.current_platform = Target()
indexer.has_deep_gemm = lambda: True
report["deepseek_v4_indexer_varlen"] = {}
for capability in capabilities:
    major, minor = (int(part) for part in capability.split("."))
    Target.capability = DeviceCapability(major, minor)
    supported = indexer.DeepseekV4IndexerBackend.supports_device_cpu_query_lens_mismatch()
    report["deepseek_v4_indexer_varlen"][capability] = supported
print("PROBE " + json.dumps(report))
