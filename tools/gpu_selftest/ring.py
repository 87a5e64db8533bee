# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""DSpark's context-ring step on random ragged batches: on CUDA under
`torch.cuda.set_sync_debug_mode("error")` against the CPU ring (no host sync allowed), on a CPU
host the CPU ring against a plain-loop reference."""

from __future__ import annotations

import argparse

from tools.gpu_selftest.report import FAILED, NEEDS_CUDA, PASSED, Outcome, cuda_available


def ragged_ring_steps(steps: int, num_slots: int, window: int, seed: int) -> list[dict]:
    """Random ragged steps: requests with prefill chunks (some longer than the window) and
    decodes, rejected rows, padding rows, and fresh slots."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    next_position = [0] * (num_slots - 1)
    out = []
    for _ in range(steps):
        requests = int(torch.randint(1, num_slots, (1,), generator=generator))
        slots = torch.randperm(num_slots - 1, generator=generator)[:requests]
        fresh = slots[torch.rand(requests, generator=generator) < 0.2]
        for slot in fresh.tolist():
            next_position[slot] = 0
        lengths = torch.randint(1, 2 * window + 2, (requests,), generator=generator)
        rejected = torch.minimum(torch.randint(0, 3, (requests,), generator=generator), lengths - 1)
        positions = []
        for slot, length, rejects in zip(
            slots.tolist(), lengths.tolist(), rejected.tolist(), strict=True
        ):
            start = next_position[slot]
            positions += list(range(start, start + length))
            next_position[slot] = start + length - rejects
        num_pad = int(torch.randint(0, 3, (1,), generator=generator))
        rows = len(positions) + num_pad
        out.append(
            {
                "query_start_loc": torch.cat([torch.zeros(1), lengths.cumsum(0)]).to(torch.int32),
                "num_valid": lengths - rejected,
                "slots_per_request": torch.cat([slots, torch.tensor([num_slots - 1])]),
                "fresh": fresh,
                "positions": torch.tensor(positions + [0] * num_pad),
                "values": torch.randn(rows, 2, generator=generator),
                "anchors": torch.tensor(
                    [next_position[s] - 1 for s in slots.tolist()], dtype=torch.int64
                ),
            }
        )
    return out


def ring_step(ring, t: dict):
    """Everything the ring proposer does with the ring in one step."""
    from vllm.v1.spec_decode.dspark.ring import rows_to_requests, valid_row_mask

    row_to_request = rows_to_requests(t["query_start_loc"], t["positions"].shape[0])
    valid = valid_row_mask(t["query_start_loc"], row_to_request, t["num_valid"])
    ring.invalidate(t["fresh"])
    ring.write(t["slots_per_request"][row_to_request], t["positions"], valid, t["values"])
    requests = t["slots_per_request"].shape[0] - 1
    return ring.read(t["slots_per_request"][:requests], t["anchors"])


def reference_ring_step(state: dict, window: int, t: dict):
    """The ring step as a plain loop: valid rows written one at a time in position order."""
    import torch

    for slot in t["fresh"].tolist():
        state[slot] = {}
    qsl, num_valid = t["query_start_loc"].tolist(), t["num_valid"].tolist()
    slots = t["slots_per_request"].tolist()
    for request in range(len(qsl) - 1):
        rows = range(qsl[request], qsl[request] + num_valid[request])
        for row in sorted(rows, key=lambda r: int(t["positions"][r])):
            position = int(t["positions"][row])
            state.setdefault(slots[request], {})[position % window] = (position, t["values"][row])
    values, masks = [], []
    for request, anchor in enumerate(t["anchors"].tolist()):
        entries = state.get(slots[request], {})
        row_values = torch.zeros(window, 2)
        row_mask = torch.zeros(window, dtype=torch.bool)
        for entry, (tag, value) in entries.items():
            row_values[entry] = value
            row_mask[entry] = anchor - window < tag <= anchor
        values.append(row_values)
        masks.append(row_mask)
    return torch.stack(values), torch.stack(masks)


def check_ring(args: argparse.Namespace) -> Outcome:
    import torch

    from vllm.v1.spec_decode.dspark.ring import ContextRing

    num_slots, window, steps = 6, 8, 40
    cpu_ring = ContextRing(num_slots, window, (2,), torch.float32, torch.device("cpu"))
    if not cuda_available():
        state: dict = {}
        for index, t in enumerate(ragged_ring_steps(steps, num_slots, window, seed=1)):
            values, mask = ring_step(cpu_ring, t)
            ref_values, ref_mask = reference_ring_step(state, window, t)
            if not torch.equal(mask, ref_mask) or not torch.equal(values[mask], ref_values[mask]):
                return Outcome(
                    FAILED, f"cpu ring differs from the plain-loop reference at step {index}"
                )
        return Outcome(
            PASSED,
            f"cpu: {steps} ragged steps equal a plain-loop reference; "
            f"the CUDA comparison under sync_debug_mode('error') {NEEDS_CUDA}",
        )
    device = torch.device("cuda")
    cuda_ring = ContextRing(num_slots, window, (2,), torch.float32, device)
    for index, t in enumerate(ragged_ring_steps(steps, num_slots, window, seed=1)):
        expected, expected_mask = ring_step(cpu_ring, t)
        on_device = {name: tensor.to(device) for name, tensor in t.items()}
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            values, mask = ring_step(cuda_ring, on_device)
        except RuntimeError as e:
            return Outcome(FAILED, f"step {index} synchronized with the host: {e}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        mask = mask.cpu()
        if not torch.equal(mask, expected_mask) or not torch.equal(
            values.cpu()[mask], expected[expected_mask]
        ):
            return Outcome(FAILED, f"CUDA ring differs from the CPU ring at step {index}")
    return Outcome(PASSED, f"cuda: {steps} ragged steps equal the CPU ring, no host sync")
