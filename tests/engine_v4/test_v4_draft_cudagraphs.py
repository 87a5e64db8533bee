# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The ring draft's FULL CUDA graphs (``dspark/cudagraph.py``) in the real CPU engine, the graph
replaced by its own function (``PassThroughGraph``; CPU has no CUDA graphs):

- planning and capture: the runner's own capture passes (``get_capture_descs``,
  ``_capture_cudagraphs``, with its ``use_cudagraphs`` gating of the drafter) after vLLM's own
  sizing for the DGX Spark profile, in each cudagraph mode; and the plan for vLLM's defaults;
- replay: greedy and sampled drafts through the graph path equal the eager drafts at every step
  (the same random numbers: no padding, both engines reseeded), and batches mixing greedy and
  sampled requests replay;
- metrics: vLLM's spec-decode metrics count the draft steps by how they ran.
"""

from pathlib import Path
from typing import Any

import pytest

from dspark_fixtures import standins
from dspark_fixtures.checkpoints import deepseek_v4 as tiny_v4
from dspark_fixtures.checkpoints.deepseek_v4 import PERIOD, cycle_prompt
from dspark_fixtures.cuda_graphs import (
    TEMPERATURES,
    PassThroughGraph,
    SizingArgs,
    graphs_on_cpu,
    profile_sizing_args,
    record_replays,
    rendered_serve_args,
    run_batches,
    size_as_on_cuda,
)
from dspark_fixtures.engine import TinyEngine
from tests.engine_v4.v4_harness import V4_ENGINE_ARGS, dspark

# --- Planning and capture -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def spark(spark_model) -> SizingArgs:
    """The DGX Spark profile's sizing values, read from the launcher's rendered arguments."""
    args = rendered_serve_args("deepseek-v4-flash-2x-spark", spark_model.parent)
    return profile_sizing_args(args, spark_model)


@pytest.fixture(scope="module")
def spark_model(tmp_path_factory) -> Path:
    """A tiny V4 target whose draft is trained for the profile's k = 5 (as V4-Flash's is)."""
    standins.install_standins()
    config = {**tiny_v4.TINY_V4_CONFIG, "dspark_block_size": 5}
    root = tmp_path_factory.mktemp("spark-v4") / "model"
    return tiny_v4.save_v4_target(root, tiny_v4.random_v4_checkpoint(config), config)


@pytest.fixture(scope="module")
def spark_engine(spark, spark_model):
    """The DGX Spark profile's values (max_num_seqs 6, k 5, 8192 batched tokens, probabilistic
    drafts, no capture flags) on the tiny V4 target."""
    from vllm.v1.spec_decode.dspark import ring_proposer

    assert spark.max_capture_size is None and spark.capture_sizes is None
    spec = dspark(spark.num_speculative_tokens, draft_sample_method=spark.draft_sample_method)
    with pytest.MonkeyPatch.context() as monkeypatch:
        graphs_on_cpu(monkeypatch, ring_proposer)
        engine_args = {
            **V4_ENGINE_ARGS,
            "max_num_seqs": spark.max_num_seqs,
            "max_num_batched_tokens": spark.max_num_batched_tokens,
        }
        with TinyEngine(spark_model, spec, **engine_args) as engine:
            yield engine


def run_capture_passes(runner, mode, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the V1 runner does on a CUDA host whose attention supports every mode: vLLM's
    sizing (``size_as_on_cuda``), the runner's ``_check_and_update_cudagraph_mode`` (resolve,
    its dispatcher's keys, then the drafter's ``initialize_cudagraph_keys``), then its capture
    passes, which call the drafter's ``dummy_run`` with its own ``use_cudagraphs`` gating."""
    from vllm.v1.attention.backend import AttentionCGSupport

    size_as_on_cuda(runner.vllm_config, mode, monkeypatch=monkeypatch)
    backends = [{group.backend for group in groups} for groups in runner.attn_groups]
    for backend in set().union(*backends):
        builder = backend.get_builder_cls()
        monkeypatch.setattr(
            builder, "get_cudagraph_support", classmethod(lambda *_: AttentionCGSupport.ALWAYS)
        )
    # The previous mode's keys go, as vLLM's CUDA-graph memory profile drops them.
    for keys in runner.cudagraph_dispatcher.cudagraph_keys.values():
        keys.clear()
    runner._check_and_update_cudagraph_mode(backends, runner.kv_cache_config.kv_cache_groups)
    for pass_mode, descriptors in runner.cudagraph_dispatcher.get_capture_descs():
        runner._capture_cudagraphs(descriptors, pass_mode)


@pytest.mark.parametrize(
    "mode", ["FULL_AND_PIECEWISE", "FULL", "FULL_DECODE_ONLY", "PIECEWISE"], ids=str
)
def test_the_runners_capture_passes_capture_a_draft_graph_for_every_decode_batch(
    spark, spark_engine, mode, monkeypatch, caplog
):
    """After the runner's own capture passes, every decode batch of 1 to max_num_seqs requests
    replays the draft graph of the request count whose target graph holds the same batch (the
    target pads n (k + 1) tokens to a captured size s; the draft pads n to s / (k + 1)). Each
    planned size was captured once per variant (greedy, sampled), and the log names them."""
    from vllm.config.compilation import CUDAGraphMode

    runner = spark_engine.model_runner
    PassThroughGraph.calls = []
    with caplog.at_level("INFO", logger="vllm"):
        run_capture_passes(runner, CUDAGraphMode[mode], monkeypatch)
    graphs = runner.drafter.draft_graphs
    assert graphs is not None
    query_len = spark.num_speculative_tokens + 1
    for num_requests in range(1, spark.max_num_seqs + 1):
        target_mode, batch = runner.cudagraph_dispatcher.dispatch(
            num_requests * query_len, uniform_decode=True
        )
        assert target_mode != CUDAGraphMode.NONE
        for sampled in (False, True):
            assert graphs.padded_size(num_requests, sampled) == batch.num_tokens // query_len
    captured = graphs.captured()
    assert captured == graphs.captured(sampled=True) == graphs.sizes
    assert sorted(size for kind, size in PassThroughGraph.calls if kind == "capture") == sorted(
        2 * captured
    )
    logged = f"FULL CUDA graphs of the block step captured for {captured} requests"
    assert f"{logged} (greedy and sampled drafts)" in caplog.text


def test_the_plan_for_vllms_defaults_follows_the_targets_decode_graphs(spark, spark_model):
    """vLLM's defaults (no capture flags, FULL_AND_PIECEWISE, SchedulerConfig's max_num_seqs):
    each decode batch the target replays a graph for pads to the draft graph of that graph's
    request count; batches past the target's largest graph run both eagerly."""
    from tools.dry_start.capture_plan import capture_plan, resolved_as_by_the_runner
    from vllm.config import SchedulerConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    k = spark.num_speculative_tokens
    max_num_seqs = SchedulerConfig.DEFAULT_MAX_NUM_SEQS
    sizing = SizingArgs(max_num_seqs, None, k, "probabilistic", True, None, None)
    config = sizing.tiny_v4_config(spark_model)
    size_as_on_cuda(config, CUDAGraphMode.FULL_AND_PIECEWISE)
    config = resolved_as_by_the_runner(config, AttentionCGSupport.ALWAYS)
    plan = capture_plan(config)
    target = CudagraphDispatcher(config)
    target.initialize_cudagraph_keys(plan.mode, k + 1)
    covered = []
    for num_requests in range(1, max_num_seqs + 1):
        target_mode, batch = target.dispatch(num_requests * (k + 1), uniform_decode=True)
        draft = min((size for size in plan.draft_requests if size >= num_requests), default=None)
        expected = batch.num_tokens // (k + 1) if target_mode != CUDAGraphMode.NONE else None
        assert draft == expected, num_requests
        covered.append(draft is not None)
    assert any(covered) and not all(covered)


def test_no_draft_graphs_with_enforce_eager_a_target_without_graphs_or_off_cuda(spark, spark_model):
    """The plan for the Spark profile's resolved sizes, and none when the draft config says
    ``enforce_eager: true``, when the target captures nothing, or off CUDA."""
    from tools.dry_start.capture_plan import resolved_as_by_the_runner
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.spec_decode.dspark.cudagraph import draft_graph_sizes

    config = spark.tiny_v4_config(spark_model)
    size_as_on_cuda(config, CUDAGraphMode.FULL_AND_PIECEWISE)
    config = resolved_as_by_the_runner(config, AttentionCGSupport.ALWAYS)
    mode = config.compilation_config.cudagraph_mode
    assert draft_graph_sizes(config, mode, on_cuda=True) == [1, 2, 3, 4, 6]
    assert draft_graph_sizes(config, CUDAGraphMode.NONE, on_cuda=True) == []
    assert draft_graph_sizes(config, mode, on_cuda=False) == []
    config.speculative_config.enforce_eager = True
    assert draft_graph_sizes(config, mode, on_cuda=True) == []
    config.speculative_config.enforce_eager = False
    assert draft_graph_sizes(config, mode, on_cuda=True) == [1, 2, 3, 4, 6]


# --- Replay: graph path == eager path ----------------------------------------------------------

PROMPTS = [cycle_prompt(10 + PERIOD * i, 40 + 7 * i) for i in range(3)]
MAX_TOKENS = [8, 12, 16]


@pytest.fixture(scope="module")
def replay_runs(tiny_v4_models, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """The noisy tiny V4 target, k = 4, probabilistic drafts, max_num_seqs 4: one engine drafting
    eagerly, one through the graph path with graphs for [1, 2, 3, 4] requests (no padding, so
    both draw the same random numbers). Each engine runs a greedy batch and a batch mixing
    greedy and sampled requests, reseeded before each."""
    root = tmp_path_factory.mktemp("replay")
    return {path: run_path(tiny_v4_models.noisy, path, root) for path in ("eager", "graph")}


def run_path(model: Path, path: str, root: Path) -> dict[str, Any]:
    """One engine's runs. The graph engine's graphs are captured by the proposer's own
    ``dummy_run`` in a capture pass, cleared as vLLM's memory profile clears them, and captured
    again."""
    from tools.gpu_selftest.draft_graphs import greedy_agreement, sampled_agreement
    from vllm.v1.spec_decode.dspark import ring_proposer

    log = root / f"{path}.log"
    spec = dspark(4, draft_sample_method="probabilistic", dspark_draft_log=str(log))
    with pytest.MonkeyPatch.context() as monkeypatch:
        if path == "graph":
            graphs_on_cpu(monkeypatch, ring_proposer)
            monkeypatch.setattr(ring_proposer, "draft_graph_sizes", lambda *_: [1, 2, 3, 4])
        with TinyEngine(model, spec, **V4_ENGINE_ARGS, max_num_seqs=4) as engine:
            proposer = engine.model_runner.drafter
            graphs = proposer.draft_graphs
            replayed = []
            if path == "graph":
                proposer.dummy_run(1, use_cudagraphs=False, is_graph_capturing=True)
                for wrapper in graphs._graphs.values():
                    wrapper.concrete_cudagraph_entries.clear()
                assert graphs.padded_size(1) is None
                proposer.dummy_run(1, use_cudagraphs=False, is_graph_capturing=True)
                replayed = record_replays(graphs, monkeypatch)
            runs = run_batches(engine, PROMPTS, MAX_TOKENS, replayed, log)
            if graphs is not None:
                runs["agree"] = {
                    False: greedy_agreement(proposer),
                    True: sampled_agreement(proposer, seed=3),
                }
    return runs


def test_graph_path_drafts_exactly_what_the_eager_path_drafts(replay_runs):
    """Greedy and sampled: every request drafted at every step what the eager engine drafted,
    and generated the same tokens; sampled requests in a batch with greedy ones replayed the
    sampled graphs, the greedy batch the greedy ones."""
    eager, graph = replay_runs["eager"], replay_runs["graph"]
    for kind in TEMPERATURES:
        assert graph[kind]["tokens"] == eager[kind]["tokens"], kind
    assert graph["log"] == eager["log"]
    assert {sampled for _, _, sampled in graph["greedy"]["replayed"]} == {False}
    assert {sampled for _, _, sampled in graph["sampled"]["replayed"]} == {True}
    assert {(n, n) for n in (3, 2, 1)} <= {(n, size) for n, size, _ in graph["sampled"]["replayed"]}


def test_the_self_test_comparison_holds_for_every_captured_size(replay_runs):
    """``greedy_agreement`` and ``sampled_agreement`` (the GPU self-test's checks) run on the
    loaded proposer for every captured size."""
    assert replay_runs["graph"]["agree"] == {
        False: {1: True, 2: True, 3: True, 4: True},
        True: {1: True, 2: True, 3: True, 4: True},
    }


def test_spec_decode_metrics_count_draft_steps_by_how_they_ran(replay_runs):
    """``vllm:spec_decode_draft_steps{cudagraph_mode}``: the graph engine's steps that replayed
    count as FULL, the eager engine's as NONE; one count per draft step."""
    eager, graph = replay_runs["eager"], replay_runs["graph"]
    for kind in TEMPERATURES:
        replays = len(graph[kind]["replayed"])
        assert replays > 0
        assert graph[kind]["steps"] == {"NONE": 0, "PIECEWISE": 0, "FULL": replays}
        assert eager[kind]["steps"]["NONE"] == replays
        assert eager[kind]["steps"]["FULL"] == 0
