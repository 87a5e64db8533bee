# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""ContextRing: placement, validity, isolation, ragged writes, batch invariance, no host syncs."""

import ast
import importlib
import importlib.util
import inspect
import random
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from dspark_fixtures.host_syncs import HostSyncRecorder
from tests.helpers import RowIndexedSlots
from vllm.v1.spec_decode.dspark import ring as ring_module
from vllm.v1.spec_decode.dspark.ring import ContextRing, rows_to_requests, valid_row_mask
from vllm.v1.spec_decode.dspark.slot_table import SlotAssignment, SlotTable

CPU = torch.device("cpu")


def make_ring(num_slots: int = 3, window: int = 8, entry_shape=(2,)) -> ContextRing:
    return ContextRing(num_slots, window, entry_shape, torch.float32, CPU)


def row_values(ids: list[int], positions: list[int]) -> torch.Tensor:
    """A value per row that names who wrote it and for which position."""
    return torch.tensor([[float(i), float(p)] for i, p in zip(ids, positions, strict=True)])


def write_rows(ring, slots, positions, valid, ids=None):
    ids = ids if ids is not None else slots
    ring.write(
        torch.tensor(slots, dtype=torch.int64),
        torch.tensor(positions, dtype=torch.int64),
        torch.tensor(valid, dtype=torch.bool),
        row_values(ids, positions).reshape(len(slots), 2),
    )


# --- placement and validity ---------------------------------------------------------------


def test_position_t_lands_at_entry_t_mod_w_with_its_tag():
    ring = make_ring(window=8)
    write_rows(ring, [1] * 11, list(range(11)), [True] * 11)
    assert ring.tags[1].tolist() == [8, 9, 10, 3, 4, 5, 6, 7]
    assert ring.values[1, :, 1].tolist() == [8, 9, 10, 3, 4, 5, 6, 7]
    assert ring.tags[0].tolist() == [-1] * 8 and ring.tags[2].tolist() == [-1] * 8


@pytest.mark.parametrize("anchor", [0, 1, 5, 7, 8, 20])
def test_valid_length_is_min_anchor_plus_1_and_w(anchor):
    ring = make_ring(window=8)
    write_rows(ring, [0] * (anchor + 1), list(range(anchor + 1)), [True] * (anchor + 1))
    values, mask = ring.read(torch.tensor([0]), torch.tensor([anchor]))
    assert values.shape == (1, 8, 2) and mask.shape == (1, 8)
    assert int(mask.sum()) == min(anchor + 1, 8)
    assert sorted(values[0, mask[0], 1].tolist()) == list(range(max(0, anchor - 7), anchor + 1))


def test_empty_entries_are_never_valid_even_for_small_anchors():
    """Tag -1 satisfies `anchor - W < tag` when anchor < W - 1; the mask must still reject it."""
    ring = make_ring(window=8)
    write_rows(ring, [0], [0], [True])
    _, mask = ring.read(torch.tensor([0, 1]), torch.tensor([0, 3]))
    assert mask.sum(dim=1).tolist() == [1, 0]


def test_entries_outside_the_anchor_window_are_masked():
    ring = make_ring(window=4)
    write_rows(ring, [0] * 4, [10, 11, 12, 13], [True] * 4)
    _, mask = ring.read(torch.tensor([0, 0, 0]), torch.tensor([11, 16, 9]))
    assert mask.sum(dim=1).tolist() == [2, 1, 0]  # (7, 11] -> 10, 11; (12, 16] -> 13; none <= 9


def test_prefix_cache_hit_only_means_fewer_valid_entries():
    ring = make_ring(window=8)
    write_rows(ring, [0] * 3, [40, 41, 42], [True] * 3)  # positions < 40 came from the cache
    _, mask = ring.read(torch.tensor([0]), torch.tensor([42]))
    assert int(mask.sum()) == 3


def test_rejected_rows_keep_the_old_values():
    ring = make_ring(window=4)
    write_rows(ring, [0] * 4, [0, 1, 2, 3], [True] * 4, ids=[7] * 4)
    before = ring.values.clone()
    write_rows(ring, [0] * 4, [4, 5, 6, 7], [True, False, False, False], ids=[9] * 4)
    assert ring.tags[0].tolist() == [4, 1, 2, 3]
    assert torch.equal(ring.values[0, 1:], before[0, 1:])
    assert ring.values[0, 0].tolist() == [9.0, 4.0]


def test_invalidate_empties_only_the_given_slots():
    ring = make_ring(num_slots=3, window=4)
    write_rows(ring, [0, 1, 2], [0, 0, 0], [True] * 3)
    ring.invalidate(torch.tensor([2, 0]))
    assert ring.tags[:, 0].tolist() == [-1, 0, -1]
    _, mask = ring.read(torch.tensor([0, 1, 2]), torch.tensor([0, 0, 0]))
    assert mask.any(dim=1).tolist() == [False, True, False]


def test_chunk_longer_than_w_keeps_its_last_w_positions():
    ring = make_ring(num_slots=2, window=4)
    write_rows(ring, [1] * 11, list(range(11)), [True] * 10 + [False])
    assert sorted(ring.tags[1].tolist()) == [6, 7, 8, 9]
    assert ring.values[1, :, 1].tolist() == ring.tags[1].float().tolist()


def test_one_plan_serves_every_ring_of_the_same_geometry():
    slots, positions = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([3, 7, 0, 1, 9])
    valid = torch.tensor([True, True, True, False, True])
    rings = [ContextRing(2, 4, shape, torch.float32, CPU) for shape in [(2,), (3, 2)]]
    plan = rings[0].plan_write(slots, positions, valid)
    for shape in [(2,), (3, 2)]:
        values = torch.randn(5, *shape)
        shared = ContextRing(2, 4, shape, torch.float32, CPU)
        shared.apply_write(plan, values)
        direct = ContextRing(2, 4, shape, torch.float32, CPU)
        direct.write(slots, positions, valid, values)
        assert torch.equal(shared.values, direct.values)
        assert torch.equal(shared.tags, direct.tags)


# --- writes are sequential writes, done in one shot ----------------------------------------


def sequential_write(ring_state, slots, positions, valid, values, window):
    """What writing the valid rows one at a time in position order leaves behind. (The GPU
    self-test has a loop of its own, ``reference_ring_step`` in tools/gpu_selftest/ring.py: it
    runs inside the image, which ships tools/ but not tests/.)"""
    tags, vals = ring_state
    order = sorted((p, r) for r, (p, ok) in enumerate(zip(positions, valid, strict=True)) if ok)
    for position, row in order:
        tags[slots[row]][position % window] = position
        vals[slots[row]][position % window] = values[row]


@st.composite
def write_batches(draw):
    num_slots = draw(st.integers(1, 4))
    window = draw(st.integers(1, 6))
    batches = []
    for _ in range(draw(st.integers(1, 3))):
        rows = draw(st.integers(0, 24))
        batches.append(
            (
                draw(st.lists(st.integers(0, num_slots - 1), min_size=rows, max_size=rows)),
                draw(st.lists(st.integers(0, 30), min_size=rows, max_size=rows)),
                draw(st.lists(st.booleans(), min_size=rows, max_size=rows)),
            )
        )
    return num_slots, window, batches


@given(write_batches())
def test_write_equals_sequential_writes_in_position_order(case):
    num_slots, window, batches = case
    ring = ContextRing(num_slots, window, (2,), torch.float32, CPU)
    tags = [[-1] * window for _ in range(num_slots)]
    vals = [[[0.0, 0.0] for _ in range(window)] for _ in range(num_slots)]
    for call, (slots, positions, valid) in enumerate(batches):
        values = [[float(call * 1000 + row), float(p)] for row, p in enumerate(positions)]
        ring.write(
            torch.tensor(slots, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            torch.tensor(valid, dtype=torch.bool),
            torch.tensor(values).reshape(len(slots), 2),
        )
        sequential_write((tags, vals), slots, positions, valid, values, window)
        assert ring.tags.tolist() == tags
        assert ring.values.tolist() == vals


@given(write_batches(), st.integers(0, 3))
def test_a_write_for_one_request_changes_only_its_slot(case, owner):
    num_slots, window, batches = case
    owner %= num_slots
    ring = ContextRing(num_slots, window, (2,), torch.float32, CPU)
    write_rows(ring, list(range(num_slots)), [0] * num_slots, [True] * num_slots)
    _, positions, valid = batches[0]
    before_values, before_tags = ring.values.clone(), ring.tags.clone()
    write_rows(ring, [owner] * len(positions), positions, valid, ids=[99] * len(positions))
    others = [s for s in range(num_slots) if s != owner]
    assert torch.equal(ring.values[others], before_values[others])
    assert torch.equal(ring.tags[others], before_tags[others])


# --- ragged batches ------------------------------------------------------------------------


@given(
    st.lists(st.integers(0, 5), max_size=6),
    st.integers(0, 3),
    st.data(),
)
def test_rows_to_requests_and_valid_rows_match_a_plain_loop(lengths, num_pad, data):
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    num_valid = [data.draw(st.integers(0, length)) for length in lengths]
    num_rows = starts[-1] + num_pad
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    row_to_request = rows_to_requests(query_start_loc, num_rows)
    valid = valid_row_mask(query_start_loc, row_to_request, torch.tensor(num_valid))
    expected_req = [
        next(i for i in range(len(lengths)) if starts[i] <= r < starts[i + 1])
        if r < starts[-1]
        else len(lengths)
        for r in range(num_rows)
    ]
    expected_valid = [
        req < len(lengths) and r - starts[req] < num_valid[req]
        for r, req in enumerate(expected_req)
    ]
    assert row_to_request.tolist() == expected_req
    assert valid.tolist() == expected_valid


@given(
    st.lists(
        st.tuples(st.integers(1, 12), st.integers(0, 4), st.integers(0, 20)), min_size=1, max_size=4
    ),
    st.integers(0, 3),
)
def test_ragged_write_equals_one_write_per_request(requests, num_pad):
    """Mixed prefill chunks (longer than W too) and decode rows in one flat batch."""
    window, num_reqs = 4, len(requests)
    lengths = [length for length, _, _ in requests]
    num_valid = torch.tensor([max(1, length - rejected) for length, rejected, _ in requests])
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat(
        [torch.arange(s, s + n) for n, _, s in requests] + [torch.zeros(num_pad, dtype=torch.int64)]
    )
    values = torch.randn(positions.shape[0], 2)
    slots_per_request = torch.tensor([*range(num_reqs), num_reqs])  # last: scratch
    row_to_request = rows_to_requests(starts, positions.shape[0])
    valid = valid_row_mask(starts, row_to_request, num_valid)

    flat = ContextRing(num_reqs + 1, window, (2,), torch.float32, CPU)
    flat.write(slots_per_request[row_to_request], positions, valid, values)
    alone = ContextRing(num_reqs + 1, window, (2,), torch.float32, CPU)
    for i in range(num_reqs):
        rows = slice(int(starts[i]), int(starts[i]) + int(num_valid[i]))
        n = rows.stop - rows.start
        alone.write(
            torch.full((n,), i), positions[rows], torch.ones(n, dtype=torch.bool), values[rows]
        )
    assert torch.equal(flat.tags, alone.tags)
    assert torch.equal(flat.values, alone.values)
    assert flat.tags[num_reqs].tolist() == [-1] * window  # padding wrote nothing


# --- batch invariance ----------------------------------------------------------------------

WINDOW, NUM_DRAFTS, CAPACITY = 4, 3, 4


@dataclass
class Life:
    """One request from arrival to finish: its id, first position and per-step (rows, rejected)."""

    req_id: str
    start: int
    chunks: list[tuple[int, int]]


@dataclass
class Step:
    releases: list[str]  # finished/aborted ids, released before the step
    batch: list[int]  # indices into the lives, in row order
    num_pad: int


def make_scenario(rng: random.Random) -> tuple[list[Life], list[Step]]:
    """Requests with independent histories, interleaved: joins, finishes, abort-and-resubmit with
    the same id, unscheduled steps, row permutations and padding. At most CAPACITY live."""

    def new_life(req_id: str) -> Life:
        prefill = [(rng.randint(1, 2 * WINDOW + 2), 0) for _ in range(rng.randint(1, 2))]
        decode = [(NUM_DRAFTS + 1, rng.randint(0, NUM_DRAFTS)) for _ in range(rng.randint(1, 4))]
        return Life(req_id, rng.choice([0, 0, rng.randint(1, 3 * WINDOW)]), prefill + decode)

    lives: list[Life] = []
    progress: dict[int, int] = {}  # live index -> own steps done
    steps: list[Step] = []
    names = 0
    while len(lives) < 6 or progress:
        releases = []
        for i in [i for i, done in progress.items() if done == len(lives[i].chunks)]:
            del progress[i]
            releases.append(lives[i].req_id)
            if rng.random() < 0.3 and len(lives) < 6:  # aborted and resubmitted as-is
                lives.append(new_life(lives[i].req_id))
                progress[len(lives) - 1] = 0
        if len(lives) < 6 and len(progress) < CAPACITY and rng.random() < 0.6:
            lives.append(new_life(f"req-{names}"))
            names += 1
            progress[len(lives) - 1] = 0
        batch = [i for i in progress if rng.random() < 0.7]
        rng.shuffle(batch)
        for i in batch:
            progress[i] += 1
        steps.append(Step(releases, batch, rng.randint(0, 2)))
    return lives, steps


def run_steps(lives, steps, table):
    """Drive table and ring as the proposer does; per life, what each of its steps observed."""
    ring = ContextRing(CAPACITY + 1, WINDOW, (2,), torch.float32, CPU)
    cursor = {i: life.start for i, life in enumerate(lives)}
    done = defaultdict(int)
    observed = defaultdict(list)
    padding_masks = []
    for step in steps:
        for req_id in step.releases:
            table.release(req_id)
        slots, fresh = table.assign([lives[i].req_id for i in step.batch])
        if fresh:
            ring.invalidate(torch.tensor(fresh))
        starts, positions, values, num_valid, anchors = [0], [], [], [], []
        for i in step.batch:
            rows, rejected = lives[i].chunks[done[i]]
            valid = max(1, rows - rejected)
            span = range(cursor[i], cursor[i] + rows)
            positions += span
            # Rejected rows carry garbage: if they were written, reads would show it.
            values += [[float(i), float(p) if k < valid else -1.0] for k, p in enumerate(span)]
            starts.append(starts[-1] + rows)
            num_valid.append(valid)
            anchors.append(cursor[i] + valid - 1)
            cursor[i] += valid
            done[i] += 1
        positions += [0] * step.num_pad
        values += [[-2.0, -2.0]] * step.num_pad
        slots_per_request = torch.tensor([*slots, table.scratch_slot], dtype=torch.int64)
        query_start_loc = torch.tensor(starts, dtype=torch.int32)
        row_to_request = rows_to_requests(query_start_loc, len(positions))
        ring.write(
            slots_per_request[row_to_request],
            torch.tensor(positions, dtype=torch.int64),
            valid_row_mask(
                query_start_loc, row_to_request, torch.tensor(num_valid, dtype=torch.int64)
            ),
            torch.tensor(values).reshape(len(positions), 2),
        )
        read_values, mask = ring.read(
            slots_per_request[[*range(len(slots)), *[-1] * step.num_pad]],
            torch.tensor(anchors + [0] * step.num_pad),
        )
        for row, i in enumerate(step.batch):
            seen = read_values[row][mask[row]]
            tags = ring.tags[slots[row]]
            observed[i].append(
                (
                    mask[row].tolist(),
                    seen.tolist(),
                    tags.tolist(),
                    ring.values[slots[row]][tags >= 0].tolist(),
                )
            )
        padding_masks += mask[len(slots) :].tolist()
    return observed, padding_masks


def invariance_violations(lives, steps, make_table) -> list[int]:
    """Lives whose observations differ between running alone and running in the mixed batch."""
    together, _ = run_steps(lives, steps, make_table(CAPACITY))
    violations = []
    for i, life in enumerate(lives):
        alone_steps = [Step([], [i], 0) for _ in life.chunks]
        alone, _ = run_steps(lives, alone_steps, make_table(CAPACITY))
        if alone[i] != together[i]:
            violations.append(i)
    return violations


def load_reference_row_to_slot():
    path = Path(__file__).parents[2] / "benchmarks" / "slot_table_bench.py"
    spec = importlib.util.spec_from_file_location("slot_table_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ReferenceRowToSlot


class ReferenceRecipeSlots:
    """The slot mapping (`_row_to_slot`) of the public two-node DGX Spark recipe for
    DeepSeek-V4-Flash, after its fix: frees on absence, never clears, and padding reads slot 0
    (defects D1-D3)."""

    def __init__(self, capacity: int) -> None:
        self.mapping = load_reference_row_to_slot()(capacity)
        self.scratch_slot = 0

    def assign(self, req_ids):
        return SlotAssignment(self.mapping.row_to_slot(req_ids)[0], [])

    def release(self, req_id):
        pass


scenarios = st.randoms(use_true_random=False).map(make_scenario)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios)
def test_batch_invariance(scenario):
    lives, steps = scenario
    assert invariance_violations(lives, steps, SlotTable) == []
    _, padding_masks = run_steps(lives, steps, SlotTable(CAPACITY))
    assert not any(any(mask) for mask in padding_masks)


def two_requests_swapping_rows():
    lives = [Life("a", 0, [(5, 0), (4, 1), (4, 0)]), Life("b", 0, [(3, 0), (4, 2), (4, 3)])]
    steps = [Step([], [0, 1], 0), Step([], [1, 0], 1), Step([], [0, 1], 0)]
    return lives, steps


def test_batch_invariance_holds_when_rows_swap():
    assert invariance_violations(*two_requests_swapping_rows(), SlotTable) == []


def test_tests_have_teeth_row_indexed_ring_breaks_invariance():
    assert invariance_violations(*two_requests_swapping_rows(), RowIndexedSlots) != []
    find(
        scenarios,
        lambda s: invariance_violations(*s, RowIndexedSlots) != [],
        settings=settings(max_examples=200, database=None, phases=[Phase.generate]),
    )


def test_tests_have_teeth_reference_recipe_mapping_breaks_invariance():
    # b skips step 2: the recipe frees its slot, c takes it, and b comes back to c's window.
    lives = [Life("a", 0, [(2, 0)] * 3), Life("b", 0, [(2, 0)] * 2), Life("c", 0, [(3, 0)])]
    steps = [Step([], [0, 1], 0), Step([], [0, 2], 0), Step([], [0, 1], 0)]
    assert invariance_violations(lives, steps, ReferenceRecipeSlots) != []
    assert invariance_violations(lives, steps, SlotTable) == []
    find(
        scenarios,
        lambda s: invariance_violations(*s, ReferenceRecipeSlots) != [],
        settings=settings(max_examples=200, database=None, phases=[Phase.generate]),
    )


# --- no host-device synchronization --------------------------------------------------------


def ring_step_inputs(device: torch.device) -> dict[str, torch.Tensor]:
    """A ragged step (a 6-row prefill chunk longer than W, a decode row, two padding rows)."""
    tensors = {
        "query_start_loc": torch.tensor([0, 6, 7], dtype=torch.int32),
        "num_valid": torch.tensor([6, 1]),
        "slots_per_request": torch.tensor([1, 0, 2]),
        "fresh": torch.tensor([1]),
        "positions": torch.arange(9),
        "values": torch.arange(18, dtype=torch.float32).reshape(9, 2),
        "anchors": torch.tensor([5, 6]),
    }
    return {name: tensor.to(device) for name, tensor in tensors.items()}


def run_ring_step(ring: ContextRing, t: dict[str, torch.Tensor]):
    """Everything the proposer does with the ring in one step."""
    row_to_request = rows_to_requests(t["query_start_loc"], t["positions"].shape[0])
    valid = valid_row_mask(t["query_start_loc"], row_to_request, t["num_valid"])
    ring.invalidate(t["fresh"])
    ring.write(t["slots_per_request"][row_to_request], t["positions"], valid, t["values"])
    return ring.read(t["slots_per_request"][:2], t["anchors"])


def test_write_and_read_do_not_sync_with_the_host():
    ring, inputs = make_ring(num_slots=3, window=4), ring_step_inputs(CPU)
    with HostSyncRecorder() as recorder:
        run_ring_step(ring, inputs)
    assert recorder.syncs == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_write_and_read_do_not_sync_on_cuda():
    device = torch.device("cuda")
    ring = ContextRing(3, 4, (2,), torch.float32, device)
    inputs = ring_step_inputs(device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        values, mask = run_ring_step(ring, inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected, expected_mask = run_ring_step(make_ring(3, 4), ring_step_inputs(CPU))
    assert torch.equal(mask.cpu(), expected_mask)
    assert torch.equal(values.cpu()[mask.cpu()], expected[expected_mask])


@pytest.mark.parametrize(
    "syncing",
    [
        lambda x: x[x > 0],
        lambda x: x.sum().item(),
        lambda x: bool(x.any()),
        lambda x: torch.nonzero(x),
        lambda x: x.repeat_interleave(torch.tensor([1, 2, 3])),
    ],
)
def test_sync_recorder_catches_syncing_code(syncing):
    with HostSyncRecorder() as recorder:
        syncing(torch.tensor([1.0, -1.0, 2.0]))
    assert recorder.syncs != []


FORBIDDEN_CALLS = {
    "item",
    "tolist",
    "cpu",
    "numpy",
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "repeat_interleave",
    "bincount",
    "synchronize",
}


def test_ring_module_source_has_no_host_syncing_calls():
    """Catches what the CPU recorder cannot see: .cpu(), .tolist() and .numpy() are no-ops or
    bypass the dispatcher on CPU tensors but sync on GPU tensors."""
    tree = ast.parse(inspect.getsource(ring_module))
    calls = {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    assert calls & FORBIDDEN_CALLS == set()
    assert "cpu" not in {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}


@pytest.mark.parametrize("module_name", ["ring", "slot_table"])
def test_modules_need_only_the_standard_library_and_torch(module_name):
    module = importlib.import_module(f"vllm.v1.spec_decode.dspark.{module_name}")
    tree = ast.parse(inspect.getsource(module))
    roots = {
        alias.name.split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.Import)
        for alias in n.names
    }
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert roots - set(sys.stdlib_module_names) <= {"torch"}
