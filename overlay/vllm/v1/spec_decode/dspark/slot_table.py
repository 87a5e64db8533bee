"""Request-stable slots for the DSpark draft state.

vLLM's V1 runner moves requests between batch rows whenever another request finishes
(`InputBatch.condense()`) and drops running-but-unscheduled requests from the batch for a step, so
per-request state indexed by batch row reads another request's context. The table here gives each
request one slot for its whole lifetime, whatever row it sits in. It is a pure function of the
sequence of calls, so every tensor-parallel rank computes the same table from the same inputs.
"""

import heapq
from collections import Counter, OrderedDict
from collections.abc import Collection, Sequence
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
    time it is scheduled. `assign` costs O(batch size) plus O(log capacity) per new request.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"SlotTable capacity (max_num_seqs) must be >= 1, got {capacity}.")
        self.capacity = capacity
        self.scratch_slot = capacity
        self.req_id_to_slot: dict[str, int] = {}
        # A heap: heapq keeps the lowest free slot at index 0.
        self.free_slots: list[int] = list(range(capacity))
        # Mapped ids, least recently scheduled first.
        self._recency: OrderedDict[str, None] = OrderedDict()

    def assign(self, req_ids: Sequence[str]) -> SlotAssignment:
        """Slots of this step's scheduled requests (in row order), allocating for new ones."""
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
        recency = self._recency
        slots = [to_slot.get(req_id, -1) for req_id in req_ids]
        new_rows = []
        for row, req_id in enumerate(req_ids):
            if slots[row] < 0:
                new_rows.append(row)
            else:
                recency.move_to_end(req_id)
        fresh = []
        for row in new_rows:
            req_id = req_ids[row]
            if self.free_slots:
                slot = heapq.heappop(self.free_slots)
            else:
                # Every id scheduled now sits at the recency tail, and the batch fits in the
                # capacity, so the head belongs to a request outside this batch.
                victim, _ = recency.popitem(last=False)
                slot = to_slot.pop(victim)
            to_slot[req_id] = slot
            recency[req_id] = None
            slots[row] = slot
            fresh.append(slot)
        return SlotAssignment(slots, fresh)

    def release(self, req_id: str) -> None:
        """Free the slot of a finished or aborted request; a no-op for unknown ids."""
        slot = self.req_id_to_slot.pop(req_id, None)
        if slot is not None:
            del self._recency[req_id]
            heapq.heappush(self.free_slots, slot)

    def reconcile(self, live_req_ids: Collection[str]) -> None:
        """Free the slots of mapped ids that are not live (all live requests, not the batch)."""
        for req_id in [r for r in self.req_id_to_slot if r not in live_req_ids]:
            self.release(req_id)

    def padded_slots(self, slots: Sequence[int], num_rows: int) -> list[int]:
        """`slots` extended to `num_rows` with the scratch slot, for padding rows."""
        return [*slots, *[self.scratch_slot] * (num_rows - len(slots))]


def _duplicates(req_ids: Sequence[str]) -> list[str]:
    return sorted(req_id for req_id, count in Counter(req_ids).items() if count > 1)
