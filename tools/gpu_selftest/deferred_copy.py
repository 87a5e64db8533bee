# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Host-to-device copies consumed one step later: right from a fresh pinned tensor per step (what
the ring proposer uploads slots from), with one reused pinned tensor as the control that shows
the copies really ran late on this device."""

from __future__ import annotations

import argparse

from tools.gpu_selftest.report import FAILED, PASSED, Outcome


def deferred_copy_run(fresh: bool, steps: int = 8, size: int = 1 << 16) -> list[int]:
    """Steps whose device data came out wrong when each step's host data is copied
    asynchronously on a side stream (queued behind a long kernel, so the copy really runs
    late) and consumed one step later, while the host already writes the next step's data:
    into a fresh pinned tensor per step, or into one reused pinned tensor."""
    import torch

    side = torch.cuda.Stream()
    reused = torch.empty(size, dtype=torch.int64, pin_memory=True)
    keep_alive, pending, wrong = [], None, []

    def consume(step: int, device_tensor, done) -> None:
        torch.cuda.current_stream().wait_event(done)
        if not bool((device_tensor == step).all()):
            wrong.append(step)

    for step in range(steps):
        host = torch.empty(size, dtype=torch.int64, pin_memory=True) if fresh else reused
        host.fill_(step)
        keep_alive.append(host)
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            device_tensor = host.to("cuda", non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        if pending is not None:
            consume(*pending)
        pending = (step, device_tensor, done)
    assert pending is not None, "steps >= 1"
    consume(*pending)
    torch.cuda.synchronize()
    return wrong


def check_deferred_copy(args: argparse.Namespace) -> Outcome:
    fresh_wrong = deferred_copy_run(fresh=True)
    reused_wrong = deferred_copy_run(fresh=False)
    facts = {"fresh_wrong_steps": fresh_wrong, "reused_wrong_steps": reused_wrong}
    if fresh_wrong:
        return Outcome(
            FAILED, f"fresh pinned tensors gave wrong data at steps {fresh_wrong}", facts
        )
    if not reused_wrong:
        return Outcome(
            PASSED,
            "fresh pinned tensors correct; the reused one was also correct, so the copies "
            "did not overlap the host write here (inconclusive control)",
            facts,
        )
    return Outcome(
        PASSED,
        f"fresh pinned tensors correct; the reused one was wrong at {len(reused_wrong)} of 8 "
        "steps (the control: the copies really ran late on this device)",
        facts,
    )
