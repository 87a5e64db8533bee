# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""`python -m tools.dry_start ARGS` with the ring proposer planning its draft graphs from the
capture sizes before vLLM's spec-decode rounding (the plan made in `load_model`, before the
runner resolves its sizes): the dry start must refuse it."""

import runpy
import sys

from tools.dry_start import engine

create_config = engine.create_config


def plan_before_rounding(args):
    """The dry start's config, the proposer's plan made unrounded (inside the dry start's
    device, its table installed)."""
    from vllm.config.compilation import CompilationConfig
    from vllm.v1.spec_decode.dspark import ring_proposer

    adjust = CompilationConfig.adjust_cudagraph_sizes_for_spec_decode
    before: dict[str, list[int]] = {}

    def record(self, uniform_decode_query_len: int) -> None:
        before.setdefault("sizes", list(self.cudagraph_capture_sizes or []))
        adjust(self, uniform_decode_query_len)

    plan = ring_proposer.draft_graph_sizes

    def unrounded(vllm_config, cudagraph_mode, on_cuda):
        compilation = vllm_config.compilation_config
        final = compilation.cudagraph_capture_sizes
        compilation.cudagraph_capture_sizes = before["sizes"]
        try:
            return plan(vllm_config, cudagraph_mode, on_cuda)
        finally:
            compilation.cudagraph_capture_sizes = final

    CompilationConfig.adjust_cudagraph_sizes_for_spec_decode = record
    ring_proposer.draft_graph_sizes = unrounded
    return create_config(args)


engine.create_config = plan_before_rounding
sys.argv[0] = "tools.dry_start"
runpy.run_module("tools.dry_start", run_name="__main__")
