# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-slot sliding window of the last W projected target positions (the DSpark "main KV").

Every entry carries the absolute position it was written for (-1 = empty), and a read only
accepts entries whose tag lies in the reader's own window. Tags are reset when a slot changes
owner, so a request can only attend to entries it wrote itself; a prefix-cache hit, a skipped step
or an inherited slot only means fewer valid entries. Write and read are fixed-shape tensor ops
with no data-dependent shapes, so they never synchronize with the host and fit in CUDA graphs.
"""

from typing import NamedTuple

import torch


class RingWritePlan(NamedTuple):
    """Where each flat row lands; shared by every ring of the same geometry in one step."""

    targets: torch.Tensor
    """[rows] flat entry index; rows that must not write point at a hidden dump entry."""
    tags: torch.Tensor
    """[rows] int64 tag stored with the row (its absolute position)."""


class ContextRing:
    """`values [num_slots, window, *entry_shape]` with int64 position `tags [num_slots, window]`.

    `num_slots` includes the padding scratch slot. Position p of a slot lives at entry p % window.
    """

    def __init__(
        self,
        num_slots: int,
        window: int,
        entry_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_slots < 1 or window < 1:
            raise ValueError(
                f"ContextRing needs num_slots >= 1 and window >= 1, got {num_slots=}, {window=}."
            )
        self.num_slots = num_slots
        self.window = window
        num_entries = num_slots * window
        # One hidden entry past the ring absorbs every row that must not write, so a write is one
        # fixed-shape index_copy_ instead of a boolean-mask selection (which syncs on GPU).
        self._dump_entry = num_entries
        self._flat_values = torch.zeros((num_entries + 1, *entry_shape), dtype=dtype, device=device)
        self._flat_tags = torch.full((num_entries + 1,), -1, dtype=torch.int64, device=device)
        self._winner_rank = torch.empty(num_entries + 1, dtype=torch.int64, device=device)
        self.values = self._flat_values[:num_entries].view(num_slots, window, *entry_shape)
        self.tags = self._flat_tags[:num_entries].view(num_slots, window)

    def invalidate(self, slots: torch.Tensor) -> None:
        """Mark every entry of `slots` empty (call for `SlotAssignment.fresh`)."""
        self.tags.index_fill_(0, slots.to(self.tags.device, torch.int64), -1)

    def plan_write(
        self, slots: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor
    ) -> RingWritePlan:
        """Resolve which rows write where: per slot and entry, the valid row with the highest
        position wins (the last such row on ties), which is what writing the valid rows one at a
        time in position order would leave. So a chunk longer than the window keeps its last
        `window` positions, and no two rows ever write the same entry.
        """
        positions = positions.to(torch.int64)
        num_rows = positions.shape[0]
        entries = slots.to(torch.int64) * self.window + positions.remainder(self.window)
        entries = torch.where(valid, entries, self._dump_entry)
        rows = torch.arange(num_rows, dtype=torch.int64, device=positions.device)
        rank = torch.where(valid, positions * num_rows + rows, -1)
        best = self._winner_rank.fill_(-1).scatter_reduce_(0, entries, rank, "amax")
        wins = valid & (best.gather(0, entries) == rank)
        return RingWritePlan(torch.where(wins, entries, self._dump_entry), positions)

    def apply_write(self, plan: RingWritePlan, values: torch.Tensor) -> None:
        """Store `values [rows, *entry_shape]` as resolved by `plan_write`."""
        self._flat_values.index_copy_(0, plan.targets, values)
        self._flat_tags.index_copy_(0, plan.targets, plan.tags)

    def write(
        self,
        slots: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Per flat row: its slot, absolute position, validity (False for rejected drafts and
        padding) and value. Invalid rows write nothing."""
        self.apply_write(self.plan_write(slots, positions, valid), values)

    def read(self, slots: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per request: `values [B, window, *entry_shape]` of its slot and a mask `[B, window]`,
        true only where `anchor - window < tag <= anchor` (never for empty entries)."""
        slots = slots.to(self.tags.device, torch.int64)
        tags = self.tags.index_select(0, slots)
        anchors = anchors.to(torch.int64).unsqueeze(1)
        mask = (tags >= 0) & (tags > anchors - self.window) & (tags <= anchors)
        return self.values.index_select(0, slots), mask


def rows_to_requests(query_start_loc: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Request index of each of `num_rows` flat rows of a ragged batch.

    `query_start_loc` is `[B + 1]` (the unpadded prefix). Rows past the last request (padding) map
    to B, so index a `[B + 1]` per-request tensor whose last element is the padding value (for
    slots: the scratch slot).
    """
    rows = torch.arange(num_rows, dtype=query_start_loc.dtype, device=query_start_loc.device)
    return torch.searchsorted(query_start_loc[1:], rows, right=True)


def valid_row_mask(
    query_start_loc: torch.Tensor, row_to_request: torch.Tensor, num_valid: torch.Tensor
) -> torch.Tensor:
    """True for the first `num_valid[i]` rows of each request i; false for padding rows."""
    rows = torch.arange(row_to_request.shape[0], device=row_to_request.device)
    num_valid = torch.cat([num_valid, num_valid.new_zeros(1)])
    offsets = rows - query_start_loc[row_to_request]
    return offsets < num_valid[row_to_request]
