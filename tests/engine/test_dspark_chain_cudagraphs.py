# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The paged draft's FULL CUDA graphs of the stage after its forward (``cudagraph.ChainGraphs``:
base logits, Markov chain, confidence head; the forward itself replays upstream DFlash's
piecewise graphs) in the real CPU engine, the graph replaced by its own function
(``tests/cuda_graphs.py``): greedy and sampled drafts through the graphs equal the eager drafts
at every step (graphs for every batch size, so no padding and the same random numbers; both
engines reseeded), batches mixing greedy and sampled requests replay the sampled graphs, and
vLLM's spec-decode metrics count every draft step."""

from pathlib import Path
from typing import Any

import pytest
import torch

from dspark_demo.engine import TinyEngine, dspark_config, read_draft_log
from tests.cuda_graphs import graphs_on_cpu

K = 4
PROMPTS = [[5 + 3 * i + j for j in range(12 + 5 * i)] for i in range(3)]
MAX_TOKENS = [8, 12, 16]
TEMPERATURES = {"greedy": [0.0, 0.0, 0.0], "sampled": [0.0, 0.8, 1.0]}


@pytest.fixture(scope="module")
def chain_runs(tiny, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """The bigram target and draft (partial acceptance), k = 4, probabilistic drafts,
    max_num_seqs 4: one engine running the chain eagerly, one through graphs for [1, 2, 3, 4]
    requests, captured by the proposer's own ``dummy_run`` in a capture pass."""
    root = tmp_path_factory.mktemp("chain")
    return {path: run_path(tiny, path, root) for path in ("eager", "graph")}


def run_path(tiny, path: str, root: Path) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.v1.spec_decode.dspark import paged_proposer

    log = root / f"{path}.log"
    spec = dspark_config(
        tiny.bigram_draft, K, draft_sample_method="probabilistic", dspark_draft_log=str(log)
    )
    runs: dict[str, Any] = {}
    replayed: list[tuple[int, int, bool]] = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        if path == "graph":
            graphs_on_cpu(monkeypatch, paged_proposer)
            monkeypatch.setattr(paged_proposer, "draft_graph_sizes", lambda *_: [1, 2, 3, 4])
        with TinyEngine(tiny.bigram_target, spec, max_num_seqs=4) as engine:
            proposer = engine.model_runner.drafter
            graphs = proposer.chain_graphs
            if path == "graph":
                proposer.dummy_run(8, use_cudagraphs=False, is_graph_capturing=True)
                assert graphs.captured() == graphs.captured(sampled=True) == [1, 2, 3, 4]
                draft = graphs.draft

                def recorded(hidden_states, anchor_tokens, size, metadata=None):
                    replayed.append((anchor_tokens.shape[0], size, metadata is not None))
                    return draft(hidden_states, anchor_tokens, size, metadata)

                monkeypatch.setattr(graphs, "draft", recorded)
            for kind, temperatures in TEMPERATURES.items():
                params = [
                    SamplingParams(temperature=t, seed=i, max_tokens=n, ignore_eos=True)
                    for i, (t, n) in enumerate(zip(temperatures, MAX_TOKENS, strict=True))
                ]
                before = draft_steps(engine)
                torch.manual_seed(1234)
                outputs = engine.llm.generate(
                    [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False
                )
                steps = draft_steps(engine)
                runs[kind] = {
                    "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                    "steps": {mode: steps[mode] - before[mode] for mode in steps},
                    "replayed": list(replayed),
                }
                replayed.clear()
            runs["log"] = {
                request: {anchor: (r["anchor_token"], r["drafts"]) for anchor, r in records.items()}
                for request, records in read_draft_log(log).items()
            }
    return runs


def draft_steps(engine: TinyEngine) -> dict[str, float]:
    """``vllm:spec_decode_draft_steps`` by its ``cudagraph_mode`` label."""
    return {
        metric.labels["cudagraph_mode"]: metric.value
        for metric in engine.llm.get_metrics()
        if metric.name == "vllm:spec_decode_draft_steps"
    }


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
