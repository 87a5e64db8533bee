# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The paged draft's FULL CUDA graphs of the stage after its forward (``cudagraph.ChainGraphs``:
base logits, Markov chain, confidence head; the forward itself replays upstream DFlash's
piecewise graphs) in the real CPU engine, the graph replaced by its own function
(``dspark_fixtures/cuda_graphs.py``): greedy and sampled drafts through the graphs equal the eager
drafts at every step (graphs for every batch size, so no padding and the same random numbers; both
engines reseeded), batches mixing greedy and sampled requests replay the sampled graphs, and vLLM's
spec-decode metrics count every draft step."""

from pathlib import Path
from typing import Any

import pytest

from dspark_fixtures.cuda_graphs import TEMPERATURES, graphs_on_cpu, record_replays, run_batches
from dspark_fixtures.engine import TinyEngine, dspark_config

K = 4
PROMPTS = [[5 + 3 * i + j for j in range(12 + 5 * i)] for i in range(3)]
MAX_TOKENS = [8, 12, 16]


@pytest.fixture(scope="module")
def chain_runs(tiny, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """The bigram target and draft (partial acceptance), k = 4, probabilistic drafts,
    max_num_seqs 4: one engine running the chain eagerly, one through graphs for [1, 2, 3, 4]
    requests, captured by the proposer's own ``dummy_run`` in a capture pass."""
    root = tmp_path_factory.mktemp("chain")
    return {path: run_path(tiny, path, root) for path in ("eager", "graph")}


def run_path(tiny, path: str, root: Path) -> dict[str, Any]:
    from vllm.v1.spec_decode.dspark import paged_proposer

    log = root / f"{path}.log"
    spec = dspark_config(
        tiny.bigram_draft, K, draft_sample_method="probabilistic", dspark_draft_log=str(log)
    )
    with pytest.MonkeyPatch.context() as monkeypatch:
        if path == "graph":
            graphs_on_cpu(monkeypatch, paged_proposer)
            monkeypatch.setattr(paged_proposer, "draft_graph_sizes", lambda *_: [1, 2, 3, 4])
        with TinyEngine(tiny.bigram_target, spec, max_num_seqs=4) as engine:
            proposer = engine.model_runner.drafter
            graphs = proposer.draft_graphs
            replayed = []
            if path == "graph":
                proposer.dummy_run(8, use_cudagraphs=False, is_graph_capturing=True)
                assert graphs.captured() == graphs.captured(sampled=True) == [1, 2, 3, 4]
                replayed = record_replays(graphs, monkeypatch)
            return run_batches(engine, PROMPTS, MAX_TOKENS, replayed, log)


def test_chain_graphs_draft_exactly_what_the_eager_chain_drafts(chain_runs):
    eager, graph = chain_runs["eager"], chain_runs["graph"]
    for kind in TEMPERATURES:
        assert graph[kind]["tokens"] == eager[kind]["tokens"], kind
    assert graph["log"] == eager["log"]
    assert len(graph["log"]) == 6
    assert {sampled for _, _, sampled in graph["greedy"]["replayed"]} == {False}
    assert {sampled for _, _, sampled in graph["sampled"]["replayed"]} == {True}
    # Batches shrink as requests finish; each replays the graph of its own size.
    assert {(3, 3), (1, 1)} <= {(n, size) for n, size, _ in graph["sampled"]["replayed"]}


def test_every_paged_draft_step_is_counted_by_its_forwards_mode(chain_runs):
    """The paged step is counted by its draft forward's mode (upstream's piecewise graphs;
    NONE on CPU): one count per step, the same in both engines."""
    eager, graph = chain_runs["eager"], chain_runs["graph"]
    for kind in TEMPERATURES:
        steps = len(graph[kind]["replayed"])
        assert steps > 0
        assert (
            graph[kind]["steps"]
            == eager[kind]["steps"]
            == {
                "NONE": steps,
                "PIECEWISE": 0,
                "FULL": 0,
            }
        )
