# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Every draft step a serving V1 engine ran, with the proof that it replayed a FULL graph.

The DSpark proposers draft a decode batch through their FULL draft graphs (`RequestGraphs`, each
proposer's `draft_graphs`), one per padded request
count and variant (greedy, sampled). While `watching`, each `propose` call is one step: its
batch size (the runner's requests), its variant (sampled when any request samples), and whether
a FULL draft graph was replayed in it (a `torch.cuda.CUDAGraph.replay` counted by `GraphEvents`
inside `RequestGraphs._replay`). A step with no such replay drafted eagerly.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from unittest import mock

from tools.gpu_selftest.graph_events import DRAFT, REPLAY, GraphEvents


class DraftSteps:
    """Steps by (requests, variant): how many ran, how many replayed a FULL draft graph."""

    def __init__(self, events: GraphEvents) -> None:
        self.events = events
        self.steps: Counter[tuple[int, str]] = Counter()
        self.full: Counter[tuple[int, str]] = Counter()
        self._replayed = False

    @contextlib.contextmanager
    def watching(self, runner) -> Iterator[DraftSteps]:
        from vllm.v1.spec_decode.dspark.cudagraph import RequestGraphs

        drafter = runner.drafter
        propose, replay = drafter.propose, RequestGraphs._replay
        patches = contextlib.ExitStack()

        def counted_replay(graphs, *args, **kwargs):
            before = self.events.counts[DRAFT, REPLAY]
            result = replay(graphs, *args, **kwargs)
            self._replayed |= self.events.counts[DRAFT, REPLAY] > before
            return result

        def counted_propose(*args, **kwargs):
            batch = runner.input_batch
            variant = "greedy" if batch.sampling_metadata.all_greedy else "sampled"
            self._replayed = False
            result = propose(*args, **kwargs)
            key = (batch.num_reqs, variant)
            self.steps[key] += 1
            self.full[key] += self._replayed
            return result

        with patches:
            patches.enter_context(mock.patch.object(drafter, "propose", counted_propose))
            patches.enter_context(mock.patch.object(RequestGraphs, "_replay", counted_replay))
            yield self

    def as_json(self) -> list[dict]:
        return [
            {"requests": requests, "variant": variant, "steps": n, "full": self.full[key]}
            for key in sorted(self.steps)
            for requests, variant, n in [(*key, self.steps[key])]
        ]


def eager_steps(steps: list[dict]) -> list[str]:
    """The batches whose draft steps ran without a FULL graph, in words."""
    return [
        f"{s['steps'] - s['full']} of {s['steps']} {s['variant']} steps of {s['requests']} requests"
        for s in steps
        if s["full"] < s["steps"]
    ]
