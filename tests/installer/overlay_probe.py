# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Run in a subprocess by test_vllm_033_overlay.py: import every overlay module from the vLLM
tree given first on the command line, build the DSpark config path (EngineArgs ->
VllmConfig -> the proposer) against it, and print what happened as JSON.

Nothing of ours is stubbed; the tree's vLLM is imported with the environment's CPU torch and
its CPU platform (VLLM_TARGET_DEVICE=cpu, set by the caller)."""

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


def module_name(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def last_line(error: BaseException) -> str:
    return traceback.format_exception_only(error)[-1].strip()


report: dict = {"vllm": vllm.__version__, "vllm_file": vllm.__file__, "torch": torch.__version__}
overlay = yaml.safe_load((project / "recipe" / "pins.yaml").read_text())["overlay"]
report["imports"] = {}
for path in overlay:
    try:
        importlib.import_module(module_name(path))
        report["imports"][path] = "ok"
    except Exception as error:
        report["imports"][path] = last_line(error)
try:
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(
        model=str(target),
        dtype="float32",
        max_model_len=256,
        block_size=32,
        enforce_eager=True,
        speculative_config={
            "method": "dspark",
            "model": str(draft),
            "num_speculative_tokens": 4,
            "dspark_confidence_scheduler": "threshold",
            "dspark_confidence_threshold": 0.5,
        },
    ).create_engine_config()
    report["method"] = config.speculative_config.method
    report["dspark_confidence_scheduler"] = config.speculative_config.dspark_confidence_scheduler
    from vllm.v1.spec_decode.dspark_proposer import make_dspark_proposer

    proposer = make_dspark_proposer(config, torch.device("cpu"))
    report["proposer"] = type(proposer).__name__
    report["scheduler"] = proposer.options.scheduling.scheduler
except Exception as error:
    report["config_error"] = last_line(error)
print("PROBE " + json.dumps(report))
