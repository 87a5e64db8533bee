# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Request-stable slots for the DSpark draft state.

vLLM's V1 runner moves requests between batch rows whenever another request finishes
(`InputBatch.condense()`) and drops running-but-unscheduled requests from the batch for a step, so
per-request state indexed by batch row reads another request's context. The table here gives each
request one slot for its whole lifetime, whatever row it sits in. It is a pure function of the
sequence of calls, so every tensor-parallel rank computes the same table from the same inputs.
"""

from collections import Counter
from collections.abc import Collection, Sequence
from heapq import heappop, heappush, nsmallest
from itertools import repeat
from typing import NamedTuple


class SlotAssignment(NamedTuple):
    slots: list[int]
    """Slot of `req_ids[i]` at `slots[i]`, in batch-row order."""
    fresh: list[int]
    """Slots handed to a new owner in this call; their ring contents must be invalidated."""


class SlotTable:
    """Maps request ids to slots `0..capacity-1`; slot `capacity` is the padding scratch slot.

    A request keeps its slot until `release` (finished or aborted) or `reconcile` (no longer live)
    frees it, so running-but-unscheduled and preempted requests keep their windows. New requests
    take the lowest free slot (a single stream always uses slot 0). When no slot is free, the least
    recently scheduled request outside the current batch loses its slot and restarts empty the next
    time it is scheduled. `assign` costs O(batch size) plus O(log capacity) per new request, and
    O(capacity) on the rare steps that must evict.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"SlotTable capacity (max_num_seqs) must be >= 1, got {capacity}.")
        self.capacity = capacity
        self.scratch_slot = capacity
        self.req_id_to_slot: dict[str, int] = {}
        # A heap: heapq keeps the lowest free slot at index 0.
        self.free_slots: list[int] = list(range(capacity))
        # Least-recently-scheduled eviction only ranks ids outside the batch, so recency is
        # recorded when a mapped id leaves the batch (the step it was last scheduled in), and
        # steps where every mapped id is scheduled record nothing.
        self._last_scheduled: dict[str, int] = {}
        self._prev_batch: set[str] = set()
        self._step = 0
        # The last call's input and result: a decode step that schedules the same batch again
        # (the common case) costs one list comparison. Any release resets it.
        self._prev_req_ids: list[str] | None = None
        self._prev_slots: tuple[int, ...] = ()

    def assign(self, req_ids: Sequence[str]) -> SlotAssignment:
        """Slots of this step's scheduled requests (in row order), allocating for new ones."""
        if req_ids == self._prev_req_ids:
            return SlotAssignment(list(self._prev_slots), [])
        batch = set(req_ids)
        if len(batch) != len(req_ids):
            raise ValueError(f"Duplicate request ids in one batch: {_duplicates(req_ids)}.")
        if len(batch) > self.capacity:
            raise ValueError(
                f"A batch of {len(batch)} requests exceeds the DSpark slot capacity of "
                f"{self.capacity}; the slot capacity must equal max_num_seqs. Build the proposer "
                f"with capacity = scheduler_config.max_num_seqs (or lower --max-num-seqs)."
            )
        to_slot = self.req_id_to_slot
        # map(), list.count and list.index keep the per-row work in C; -1 marks new requests.
        slots = list(map(to_slot.get, req_ids, repeat(-1)))
        num_new = slots.count(-1)
        self._step += 1
        if len(to_slot) > len(req_ids) - num_new:  # some mapped request sits outside the batch
            self._record_departures(batch)
        self._prev_batch = batch
        if num_new > len(self.free_slots):
            self._evict(num_new - len(self.free_slots), batch)
        # New requests, in row order, take the lowest free slots in ascending order.
        fresh = [heappop(self.free_slots) for _ in range(num_new)]
        row = -1
        for slot in fresh:
            row = slots.index(-1, row + 1)
            slots[row] = slot
            to_slot[req_ids[row]] = slot
        self._prev_req_ids = list(req_ids)
        self._prev_slots = tuple(slots)
        return SlotAssignment(slots, fresh)

    def release(self, req_id: str) -> None:
        """Free the slot of a finished or aborted request; a no-op for unknown ids."""
        slot = self.req_id_to_slot.pop(req_id, None)
        if slot is not None:
            self._prev_req_ids = None
            self._last_scheduled.pop(req_id, None)
            heappush(self.free_slots, slot)

    def reconcile(self, live_req_ids: Collection[str]) -> None:
        """Free the slots of mapped ids that are not live (all live requests, not the batch)."""
        for req_id in [r for r in self.req_id_to_slot if r not in live_req_ids]:
            self.release(req_id)

    def _record_departures(self, batch: set[str]) -> None:
        """Remember the last step of every mapped request that was scheduled then but not now."""
        for req_id in self._prev_batch - batch:
            if req_id in self.req_id_to_slot:
                self._last_scheduled[req_id] = self._step - 1

    def _evict(self, count: int, batch: set[str]) -> None:
        """Release the `count` least recently scheduled requests outside `batch` (ties: the one
        that got its slot first). O(capacity), only on steps where no slot is free."""
        outside = (req_id for req_id in self.req_id_to_slot if req_id not in batch)
        for req_id in nsmallest(count, outside, key=self._last_scheduled.__getitem__):
            self.release(req_id)


def _duplicates(req_ids: Sequence[str]) -> list[str]:
    return sorted(req_id for req_id, count in Counter(req_ids).items() if count > 1)
