# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""SlotTable: request-stable slots under random request lifetimes (the slot invariants)."""

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from vllm.v1.spec_decode.dspark.slot_table import SlotAssignment, SlotTable


def test_new_requests_take_lowest_free_slots_in_row_order():
    table = SlotTable(4)
    assert table.assign(["a", "b", "c"]) == SlotAssignment([0, 1, 2], [0, 1, 2])
    table.release("b")
    table.release("a")
    assert table.assign(["d", "c", "e"]) == SlotAssignment([0, 2, 1], [0, 1])


def test_single_stream_always_uses_slot_0():
    table = SlotTable(8)
    for i in range(5):
        for _ in range(3):
            assert table.assign([f"r{i}"]).slots == [0]
            table.assign([])  # a step that schedules nothing
        table.release(f"r{i}")


def test_slots_follow_requests_through_permutations_and_unscheduled_steps():
    table = SlotTable(4)
    table.assign(["a", "b", "c"])
    assert table.assign(["c", "a"]) == SlotAssignment([2, 0], [])  # b unscheduled, c condensed
    assert table.assign(["d"]) == SlotAssignment([3], [3])  # b keeps slot 1 while away
    assert table.assign(["b", "d", "a"]) == SlotAssignment([1, 3, 0], [])


def test_release_is_idempotent_and_abort_resubmit_gets_a_fresh_slot():
    table = SlotTable(2)
    table.assign(["a"])
    table.release("a")
    table.release("a")
    table.release("never-seen")
    assert table.free_slots == [0, 1]
    # Same id resubmitted after an abort: a new owner, so slot 0 is reported fresh again.
    assert table.assign(["a"]) == SlotAssignment([0], [0])


def test_unchanged_batch_fast_path_sees_releases():
    table = SlotTable(2)
    req_ids = ["a", "b"]
    table.assign(req_ids)
    assert table.assign(req_ids) == SlotAssignment([0, 1], [])
    table.release("b")  # aborted and resubmitted between two identical batches
    assert table.assign(req_ids) == SlotAssignment([0, 1], [1])
    # The caller may mutate its list in place (InputBatch does); the table must notice.
    req_ids[1] = "c"
    assert table.assign(req_ids) == SlotAssignment([0, 1], [1])  # b evicted for c


def test_reconcile_frees_only_requests_that_are_not_live():
    table = SlotTable(3)
    table.assign(["a", "b", "c"])
    table.assign(["c"])  # a and b unscheduled this step, still live
    table.reconcile({"a", "c"})
    assert table.req_id_to_slot == {"a": 0, "c": 2}
    assert table.free_slots == [1]


def test_full_table_evicts_least_recently_scheduled_request_outside_the_batch():
    table = SlotTable(3)
    table.assign(["a", "b", "c"])
    table.assign(["b", "c"])  # a last scheduled at step 1
    table.assign(["c"])  # b last scheduled at step 2
    assert table.assign(["c", "d"]) == SlotAssignment([2, 0], [0])  # a evicted
    assert table.assign(["d", "e"]) == SlotAssignment([0, 1], [1])  # then b
    assert table.assign(["a"]) == SlotAssignment([2], [2])  # then c; a restarts empty
    assert table.req_id_to_slot == {"d": 0, "e": 1, "a": 2}


def test_too_many_distinct_requests_is_a_clear_configuration_error():
    table = SlotTable(2)
    with pytest.raises(ValueError, match=r"3 requests exceeds .* capacity of 2.*max_num_seqs"):
        table.assign(["a", "b", "c"])
    assert table.req_id_to_slot == {}  # nothing half-assigned


def test_duplicate_ids_in_one_batch_are_rejected():
    table = SlotTable(4)
    with pytest.raises(ValueError, match=r"Duplicate request ids in one batch: \['a'\]"):
        table.assign(["a", "b", "a"])


@given(st.lists(st.lists(st.sampled_from("abcdefgh"), max_size=4, unique=True), max_size=30))
def test_assignment_is_a_pure_function_of_the_calls(batches):
    """Two tables (two tensor-parallel ranks) fed the same calls agree on every slot."""
    rank0, rank1 = SlotTable(4), SlotTable(4)
    for i, batch in enumerate(batches):
        assert rank0.assign(batch) == rank1.assign(list(batch))
        if i % 3 == 2 and batch:
            rank0.release(batch[0])
            rank1.release(batch[0])


class SlotTableLifetimes(RuleBasedStateMachine):
    """Random request lifetimes as vLLM's runner produces them, checked against a plain model.

    The model keeps what the table must keep: the slot of each mapped request, the free slots and
    the step each request was last scheduled in. Capacity is small and live requests may
    outnumber it (unscheduled and preempted ones), so eviction happens.
    """

    schedulable = Bundle("schedulable")

    @initialize(capacity=st.integers(1, 4))
    def setup(self, capacity):
        self.table = SlotTable(capacity)
        self.capacity = capacity
        self.live: set[str] = set()
        self.preempted: set[str] = set()
        self.slot_of: dict[str, int] = {}
        self.last_step: dict[str, int] = {}
        self.step_no = 0
        self.next_id = 0

    def _forget(self, req_id):
        self.slot_of.pop(req_id, None)
        self.last_step.pop(req_id, None)

    @precondition(lambda self: len(self.live) < 7)
    @rule(target=schedulable)
    def arrive(self):
        req_id = f"req-{self.next_id}"
        self.next_id += 1
        self.live.add(req_id)
        return req_id

    @rule(req_id=consumes(schedulable))
    def finish(self, req_id):
        self.live.discard(req_id)
        self.preempted.discard(req_id)
        self.table.release(req_id)
        self._forget(req_id)

    @rule(req_id=consumes(schedulable))
    def finish_without_release(self, req_id):
        """The runner missed the release hook; only `reconcile` can free the slot."""
        self.live.discard(req_id)
        self.preempted.discard(req_id)

    @rule(req_id=schedulable)
    def abort_and_resubmit(self, req_id):
        if req_id in self.live:
            self.table.release(req_id)
            self._forget(req_id)
            self.preempted.discard(req_id)

    @rule(req_id=schedulable)
    def preempt(self, req_id):
        if req_id in self.live:
            self.preempted.add(req_id)

    @rule(req_id=schedulable)
    def resume(self, req_id):
        self.preempted.discard(req_id)

    @rule()
    def reconcile(self):
        self.table.reconcile(set(self.live))
        for req_id in [r for r in self.slot_of if r not in self.live]:
            self._forget(req_id)

    @rule(data=st.data())
    def step(self, data):
        running = sorted(self.live - self.preempted)
        batch = data.draw(st.permutations(running)).copy()
        batch = batch[: data.draw(st.integers(0, min(len(batch), self.capacity)))]
        mapped_before = dict(self.slot_of)
        self.step_no += 1

        slots, fresh = self.table.assign(batch)

        assert len(slots) == len(batch)
        kept = [r for r in batch if r in mapped_before]
        new = [r for r in batch if r not in mapped_before]
        for req_id, slot in zip(batch, slots, strict=True):
            if req_id in mapped_before:  # stability: a mapped request never moves
                assert slot == mapped_before[req_id]
        # Evictions: exactly as many as the free slots could not cover, chosen least recently
        # scheduled among the mapped requests outside the batch.
        free_before = set(range(self.capacity)) - set(mapped_before.values())
        num_evicted = max(0, len(new) - len(free_before))
        outside = [r for r in mapped_before if r not in batch]
        evicted = [r for r in outside if r not in self.table.req_id_to_slot]
        assert len(evicted) == num_evicted
        event(f"evicted {min(num_evicted, 2)}+")
        if evicted:
            survivors = [r for r in outside if r not in evicted]
            oldest_survivor = min((self.last_step[r] for r in survivors), default=None)
            if oldest_survivor is not None:
                assert max(self.last_step[r] for r in evicted) <= oldest_survivor
        # Lowest-first: new requests, in row order, take the lowest available slots.
        available = sorted(free_before | {mapped_before[r] for r in evicted})
        assert [slots[batch.index(r)] for r in new] == available[: len(new)]
        assert fresh == available[: len(new)]
        assert not set(fresh) & {mapped_before[r] for r in kept}

        for req_id in evicted:
            self._forget(req_id)
        for req_id, slot in zip(batch, slots, strict=True):
            self.slot_of[req_id] = slot
            self.last_step[req_id] = self.step_no
        assert self.capacity not in slots

    @invariant()
    def table_matches_model_and_is_a_bijection(self):
        if not hasattr(self, "table"):
            return
        mapping = self.table.req_id_to_slot
        assert mapping == self.slot_of
        assert len(set(mapping.values())) == len(mapping)
        assert all(0 <= slot < self.capacity for slot in mapping.values())
        assert sorted(self.table.free_slots) == sorted(
            set(range(self.capacity)) - set(mapping.values())
        )
        assert self.table.free_slots[:1] == sorted(self.table.free_slots)[:1]


TestSlotTableLifetimes = SlotTableLifetimes.TestCase
TestSlotTableLifetimes.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
