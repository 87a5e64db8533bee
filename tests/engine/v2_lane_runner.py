# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Run in a subprocess by test_v2_lane.py: real engines on Model Runner V2, hosted on the CPU
by ``dspark_fixtures/cpu_mrv2.py`` (which must be installed before vLLM is imported, hence a
process of its own), one after another, and print what each produced as JSON.

Argument: a JSON file, a list of engines ``{"target", "speculative_config", "engine_args",
"runs": [{"prompts", "max_tokens", "sampling"}], "count_step"}`` (``sampling``:
``TinyEngine.generate``'s keywords, ``structured_outputs`` as a dict); each engine serves its
runs in order, so a later run can start from an earlier one's prefix-cache hit. With
``"count_step": batch``, an engine then counts one greedy draft step of that batch
(``benchmarks/draft_step_lanes.py``)."""

import json
import sys
import time
from pathlib import Path

from dspark_fixtures import cpu_mrv2

cpu_mrv2.install()

from vllm.sampling_params import StructuredOutputsParams  # noqa: E402, I001

from benchmarks.draft_step_lanes import cost_json, measure_v2_step  # noqa: E402
from dspark_fixtures.engine import TinyEngine  # noqa: E402


def serve(engine: dict) -> dict:
    started = time.perf_counter()
    with TinyEngine(
        engine["target"], engine["speculative_config"], **engine["engine_args"]
    ) as tiny:
        seconds = time.perf_counter() - started
        runner = tiny.model_runner
        runs = []
        for run in engine["runs"]:
            sampling = dict(run.get("sampling", {}))
            if "structured_outputs" in sampling:
                sampling["structured_outputs"] = StructuredOutputsParams(
                    **sampling["structured_outputs"]
                )
            result = tiny.generate(run["prompts"], run["max_tokens"], **sampling)
            runs.append(
                {
                    "token_ids": result.token_ids,
                    "accepted_per_position": result.accepted_per_position,
                    "drafts": result.drafts,
                    "prefix_cache_hits": result.metrics.get("vllm:prefix_cache_hits", 0),
                    "seconds": result.seconds,
                }
            )
        speculator = getattr(runner, "speculator", None)
        count = engine.get("count_step")
        step = None if count is None else cost_json(measure_v2_step(tiny, count))
        return {
            "runner": f"{type(runner).__module__}.{type(runner).__qualname__}",
            "speculator": type(speculator).__qualname__,
            "start_seconds": seconds,
            "runs": runs,
            "step_cost": step,
        }


engines = json.loads(Path(sys.argv[1]).read_text())
report = {
    "engines": [serve(engine) for engine in engines],
    "overlay_modules_imported": sorted(
        name for name in sys.modules if name.startswith("vllm.v1.spec_decode.dspark")
    ),
}
print("PROBE " + json.dumps(report))
