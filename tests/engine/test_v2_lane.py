# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The V2 lane served: upstream vLLM's DSpark on Model Runner V2, with DSpark installed, on the
CPU under Triton's interpreter (``dspark_fixtures/cpu_mrv2.py``), against the V1 lane on the same
tiny pairs and prompts, for Qwen3 and Gemma-4.

Every V2 engine runs in one subprocess (``v2_lane_runner.py``: the host must be installed
before vLLM is imported), started first so that it runs while the V1 engines run here. Per
family: the bigram pair serves a greedy batch, then a second turn that starts from a
prefix-cache hit, a sampled request and a structured-output request, then counts one draft
step's launches (``benchmarks/draft_step_lanes.py``); the oracle pair a greedy request; last,
Qwen3's bigram pair with probabilistic drafts a sampled request. Here:
plain vLLM and the V1 lane's DSpark serve the same greedy runs in the same order on one engine
each, and the V1 lane the structured-output request.

Equal per-position acceptance on the two lanes is the check that both draft the same tokens
(the tokens themselves are verified, so equal output alone would not show it); docs/lanes.md
has the control: without the per-layer context K-norm patch (``qwen3-dflash``) V2's Qwen3
acceptance differs from V1's."""

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from dspark_fixtures.engine import EngineRun, TinyEngine, dspark_config
from tests.helpers import REPO, probe_report, start_probe

pytestmark = pytest.mark.multiproc  # the V2 engines run in a subprocess

RUNNER = Path(__file__).with_name("v2_lane_runner.py")
K = 4
FAMILIES = ("qwen3", "gemma4")
# The first turn's long prompt fills whole 32-token KV blocks that the second turn hits; the
# other prompt is longer than Gemma-4's 32-token sliding window.
PREFIX_WORDS = {"qwen3": 150, "gemma4": 100}
SHORT = " ".join(f"w{(13 * i) % 500 + 300}" for i in range(40))
CHOICES = ["w10", "w20"]
STRUCTURED = {"ignore_eos": False, "structured_outputs": {"choice": CHOICES}}
SAMPLED = {"temperature": 0.8, "top_k": 50, "top_p": 0.9}


def greedy_runs(family: str) -> list[dict[str, Any]]:
    """What both lanes serve, in this order: a batch, then a second turn."""
    prefix = " ".join(f"w{(37 * i) % 990 + 5}" for i in range(PREFIX_WORDS[family]))
    return [
        {"prompts": [f"{prefix} w11 w12 w13", SHORT], "max_tokens": 12},
        {"prompts": [f"{prefix} w21 w22 w23 w24"], "max_tokens": 12},
    ]


def v2_engines(family: str, models) -> list[dict[str, Any]]:
    """The bigram pair's engine, then the oracle pair's."""
    return [
        {
            "target": str(models.bigram_target),
            "speculative_config": dspark_config(models.bigram_draft, k=K),
            "engine_args": {"max_num_seqs": 2},
            "runs": [
                *greedy_runs(family),
                {"prompts": [SHORT], "max_tokens": 8, "sampling": SAMPLED},
                {"prompts": [SHORT], "max_tokens": 4, "sampling": STRUCTURED},
            ],
            "count_step": 1,
        },
        {
            "target": str(models.zero_target),
            "speculative_config": dspark_config(models.oracle_draft, k=K),
            "engine_args": {"max_num_seqs": 1},
            "runs": [{"prompts": [SHORT], "max_tokens": 12}],
        },
    ]


def probabilistic_engine(models) -> dict[str, Any]:
    """The bigram pair drafting by sampling, serving a sampled request: the draft logits kept
    for rejection sampling and the residual resampled, through ``cpu_mrv2``'s stand-ins for
    gumbel.py's store and rejection_sampler_utils.py's ``log1p``."""
    return {
        "target": str(models.bigram_target),
        "speculative_config": dspark_config(
            models.bigram_draft, k=K, draft_sample_method="probabilistic"
        ),
        "engine_args": {"max_num_seqs": 1},
        "runs": [{"prompts": [SHORT], "max_tokens": 8, "sampling": SAMPLED}],
    }


class V2Lane:
    """The runner's subprocess, started at once; ``report`` waits for it (and leaves it beside
    the plan, for a reader of a failure)."""

    def __init__(self, plan: Path) -> None:
        self._plan = plan
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self._process = start_probe([sys.executable, str(RUNNER), str(plan)], env, REPO)

    @functools.cached_property
    def report(self) -> dict[str, Any]:
        report = probe_report(self._process)
        self._plan.with_name("report.json").write_text(json.dumps(report))
        return report

    def engines(self, family: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """That family's bigram and oracle engines."""
        index = 2 * FAMILIES.index(family)
        bigram, oracle = self.report["engines"][index : index + 2]
        return bigram, oracle


@pytest.fixture(scope="module")
def v2_lane(tiny_family, tmp_path_factory: pytest.TempPathFactory) -> V2Lane:
    plan = tmp_path_factory.mktemp("v2-lane") / "plan.json"
    engines = [engine for f in FAMILIES for engine in v2_engines(f, tiny_family(f))]
    engines.append(probabilistic_engine(tiny_family(FAMILIES[0])))
    plan.write_text(json.dumps(engines))
    return V2Lane(plan)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


def serve(engine: TinyEngine, runs: list[dict[str, Any]]) -> list[EngineRun]:
    return [
        engine.generate(run["prompts"], run["max_tokens"], **run.get("sampling", {}))
        for run in runs
    ]


@pytest.fixture(scope="module")
def v1_lane(v2_lane, family, tiny_family) -> dict[str, list[EngineRun]]:
    """Plain vLLM's and the V1 lane's runs, while the V2 lane's subprocess runs."""
    from vllm.sampling_params import StructuredOutputsParams

    models = tiny_family(family)
    structured = {**STRUCTURED, "structured_outputs": StructuredOutputsParams(choice=CHOICES)}
    with TinyEngine(models.bigram_target, max_num_seqs=2) as engine:
        plain = serve(engine, greedy_runs(family))
    with TinyEngine(
        models.bigram_target, dspark_config(models.bigram_draft, k=K), max_num_seqs=2
    ) as engine:
        v1 = serve(
            engine,
            [*greedy_runs(family), {"prompts": [SHORT], "max_tokens": 4, "sampling": structured}],
        )
    return {"plain": plain, "dspark": v1}


def test_the_v2_lane_is_model_runner_v2_with_upstream_dspark(v2_lane, v1_lane):
    """(``v1_lane`` first: the V1 engines run while the V2 subprocess does.)"""
    for engine in v2_lane.report["engines"]:
        assert engine["runner"] == "vllm.v1.worker.cpu.model_runner.CPUModelRunner"
        assert engine["speculator"] == "DSparkSpeculator"
    assert v2_lane.report["overlay_modules_imported"] == []


def test_greedy_output_equals_plain_vllm(v2_lane, v1_lane, family):
    bigram, _ = v2_lane.engines(family)
    for v2, plain in zip(bigram["runs"][:2], v1_lane["plain"], strict=True):
        assert v2["token_ids"] == plain.token_ids


def test_an_always_right_draft_is_always_accepted(v2_lane, family):
    _, oracle = v2_lane.engines(family)
    (run,) = oracle["runs"]
    assert run["drafts"] > 0
    assert run["accepted_per_position"] == [run["drafts"]] * K
    assert all(set(tokens) == {0} for tokens in run["token_ids"])


def test_acceptance_per_position_equals_the_v1_lane(v2_lane, v1_lane, family):
    """Both greedy runs; the second starts from a prefix-cache hit on both lanes, so a V2 draft
    blind to the cached context would accept otherwise there (upstream vllm#47930; zeroing
    V2's draft KV cache between the runs changed it, docs/lanes.md)."""
    bigram, _ = v2_lane.engines(family)
    for v2, v1 in zip(bigram["runs"][:2], v1_lane["dspark"][:2], strict=True):
        assert (v2["drafts"], v2["accepted_per_position"]) == (v1.drafts, v1.accepted_per_position)
    first, second = bigram["runs"][:2]
    # Meaningful only with drafts both accepted and rejected, and a hit.
    assert 0 < first["accepted_per_position"][0] < first["drafts"]
    assert second["prefix_cache_hits"] > 0
    assert v1_lane["dspark"][1].metrics["vllm:prefix_cache_hits"] > 0


def test_sampled_drafts_run(v2_lane, family):
    bigram, _ = v2_lane.engines(family)
    sampled = bigram["runs"][2]
    assert sampled["drafts"] > 0
    assert [len(tokens) for tokens in sampled["token_ids"]] == [8]


def test_probabilistic_drafts_run(v2_lane):
    engine = v2_lane.report["engines"][2 * len(FAMILIES)]
    assert engine["speculator"] == "DSparkSpeculator"
    (sampled,) = engine["runs"]
    assert sampled["drafts"] > 0
    assert [len(tokens) for tokens in sampled["token_ids"]] == [8]


def test_a_structured_output_request_is_served(v2_lane, v1_lane, family):
    bigram, _ = v2_lane.engines(family)
    structured = bigram["runs"][3]
    assert structured["token_ids"] == v1_lane["dspark"][2].token_ids
    # The grammar changed the output: unconstrained, the prompt continues otherwise.
    (tokens,) = structured["token_ids"]
    assert tokens != v1_lane["plain"][0].token_ids[1][: len(tokens)]


def test_the_draft_step_is_counted_with_its_triton_kernels(v2_lane, family):
    """``benchmarks/draft_step_lanes.py``'s count of one greedy V2 draft step at batch 1:
    upstream's input preparation is one Triton kernel per draft KV-cache group (one here), run
    eagerly before the FULL graph. Control: with the Triton hook removed
    (``triton_launches_counted`` a null context), this fails."""
    bigram, _ = v2_lane.engines(family)
    cost = bigram["step_cost"]
    by_op = {(phase, name): count for phase, name, count in cost["by_op"]}
    assert sum(cost["launches"].values()) > 0
    assert by_op.get(("eager", "triton::_prepare_dflash_inputs_kernel")) == 1
