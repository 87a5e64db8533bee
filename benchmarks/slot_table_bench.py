# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Per-step bookkeeping cost of SlotTable vs `_row_to_slot` of the V1 DSpark proposer
in the public two-node DGX Spark recipe for DeepSeek-V4-Flash.

Both mappings see the same pre-generated workload: a full batch of `B` requests (max_num_seqs = B)
where each request finishes with probability 1/16 per step and is replaced by a new one, rows
condensed the way vLLM's `InputBatch.condense()` fills holes. SlotTable is charged for its
`release` calls too; `_row_to_slot` frees slots by absence inside `_row_to_slot`. Only host
bookkeeping is timed (both hand the same list of ints to the device afterwards).

    python benchmarks/slot_table_bench.py
"""

import argparse
import random
import statistics
import time
from collections.abc import Sequence

from vllm.v1.spec_decode.dspark.slot_table import SlotTable

BATCH_SIZES = (1, 8, 64, 256, 1024)


class ReferenceRowToSlot:
    """That recipe's mapping, kept faithful, defects included:
    free every mapped id absent from the batch, sort the free list, reuse a slot or take the lowest
    free one, and report whether the result is the identity permutation (its fast path)."""

    def __init__(self, max_num_seqs: int) -> None:
        self._req_id_to_slot: dict[str, int] = {}
        self._free_slots = list(range(max_num_seqs))

    def row_to_slot(self, req_ids: Sequence[str]) -> tuple[list[int], bool]:
        present = set(req_ids)
        for req_id in [r for r in self._req_id_to_slot if r not in present]:
            self._free_slots.append(self._req_id_to_slot.pop(req_id))
        self._free_slots.sort()
        slots = []
        for req_id in req_ids:
            slot = self._req_id_to_slot.get(req_id)
            if slot is None:
                slot = self._free_slots.pop(0)
                self._req_id_to_slot[req_id] = slot
            slots.append(slot)
        is_identity = all(slot == row for row, slot in enumerate(slots))
        return slots, is_identity


def condense(rows: list[str], finished: set[str]) -> list[str]:
    """Remove `finished` the way `InputBatch.condense()` does: the last rows fill the holes."""
    kept: list[str | None] = [None if r in finished else r for r in rows]
    hole = 0
    while True:
        while kept and kept[-1] is None:
            kept.pop()
        while hole < len(kept) and kept[hole] is not None:
            hole += 1
        if hole >= len(kept):
            return kept  # type: ignore[return-value]
        kept[hole] = kept.pop()


def make_workload(
    batch_size: int, num_steps: int, churn: float, seed: int
) -> list[tuple[list[str], list[str]]]:
    """Per step: (ids finished before it, scheduled ids in row order)."""
    rng = random.Random(seed)
    next_id = 0
    rows: list[str] = []
    steps = []
    for _ in range(num_steps):
        finished = [r for r in rows if rng.random() < churn]
        rows = condense(rows, set(finished))
        while len(rows) < batch_size:
            rows.append(f"req-{next_id}")
            next_id += 1
        steps.append((finished, list(rows)))
    return steps


def time_slot_table(capacity: int, workload: list[tuple[list[str], list[str]]]) -> float:
    table = SlotTable(capacity)
    start = time.perf_counter_ns()
    for finished, req_ids in workload:
        for req_id in finished:
            table.release(req_id)
        table.assign(req_ids)
    return (time.perf_counter_ns() - start) / len(workload)


def time_reference(capacity: int, workload: list[tuple[list[str], list[str]]]) -> float:
    mapping = ReferenceRowToSlot(capacity)
    start = time.perf_counter_ns()
    for _, req_ids in workload:
        mapping.row_to_slot(req_ids)
    return (time.perf_counter_ns() - start) / len(workload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed runs per size (median)")
    parser.add_argument("--rows", type=int, default=200_000, help="scheduled rows per timed run")
    parser.add_argument("--churn", type=float, default=1 / 16, help="finish probability per step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print(
        f"churn {args.churn:.4f}/request/step, {args.rows} rows per run, "
        f"median of {args.repeats} runs, times in microseconds per step"
    )
    print(f"{'batch':>6} {'SlotTable':>10} {'reference':>10} {'ref/ours':>9} {'ours ns/row':>12}")
    for batch_size in BATCH_SIZES:
        num_steps = max(100, args.rows // batch_size)
        workload = make_workload(batch_size, num_steps, args.churn, args.seed)
        ours, ref = [], []
        for _ in range(args.repeats):  # interleaved, so drift hits both alike
            ours.append(time_slot_table(batch_size, workload))
            ref.append(time_reference(batch_size, workload))
        ours_ns, ref_ns = statistics.median(ours), statistics.median(ref)
        print(
            f"{batch_size:>6} {ours_ns / 1e3:>10.2f} {ref_ns / 1e3:>10.2f} "
            f"{ref_ns / ours_ns:>9.2f} {ours_ns / batch_size:>12.1f}"
        )


if __name__ == "__main__":
    main()
