# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Count the CUDA graphs a real engine captures and replays, and whose they are: the drafter's or
the target's.

Every graph vLLM makes, whatever wraps it (`CUDAGraphWrapper`, its breakable variant, Model Runner
V2's graph managers, `DraftGraphs`), is a `torch.cuda.CUDAGraph` that is captured through
`capture_begin` and replayed through `replay`. Patched for the engine's lifetime, those two
methods count each call, as the drafter's when a method of the drafter (an instance of
`drafter_types`) is on the call stack: the runner calls the drafter's `dummy_run` in its capture
pass and its `propose` in every step, and the target's graphs are captured and replayed outside
both.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator
from types import FrameType

DRAFT, TARGET = "draft", "target"
CAPTURE, REPLAY = "capture", "replay"
_METHODS = {"capture_begin": CAPTURE, "replay": REPLAY}


class GraphEvents:
    """Captures and replays by owner, while `recording` is active."""

    def __init__(self, drafter_types: tuple[type, ...]) -> None:
        self.drafter_types = drafter_types
        self.counts: Counter[tuple[str, str]] = Counter()

    def owner(self) -> str:
        """DRAFT when a drafter's method is on the caller's stack, else TARGET."""
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if isinstance(frame.f_locals.get("self"), self.drafter_types):
                return DRAFT
            frame = frame.f_back
        return TARGET

    def snapshot(self) -> dict[str, int]:
        """{"draft capture": n, "draft replay": n, "target capture": n, "target replay": n}."""
        return {
            f"{owner} {event}": self.counts[owner, event]
            for owner in (DRAFT, TARGET)
            for event in (CAPTURE, REPLAY)
        }

    @contextlib.contextmanager
    def recording(self, graph_class: type) -> Iterator[GraphEvents]:
        """Count `graph_class`'s captures and replays (`torch.cuda.CUDAGraph`) until exit."""
        originals = {name: graph_class.__dict__.get(name) for name in _METHODS}

        def counted(name: str, event: str):
            method = getattr(graph_class, name)

            def call(graph, *args, **kwargs):
                self.counts[self.owner(), event] += 1
                return method(graph, *args, **kwargs)

            return call

        for name, event in _METHODS.items():
            setattr(graph_class, name, counted(name, event))
        try:
            yield self
        finally:
            for name, original in originals.items():
                if original is None:
                    delattr(graph_class, name)
                else:
                    setattr(graph_class, name, original)
