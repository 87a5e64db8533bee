# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``dspark_draft_log``: every step's drafts per request, one JSON line each (debug only)."""

import json
import os

import torch

from vllm.distributed import get_tensor_model_parallel_rank


def append_draft_log(
    path: str,
    req_ids: list[str],
    anchors: torch.Tensor,
    anchor_tokens: torch.Tensor,
    drafts: torch.Tensor,
    lengths: torch.Tensor | None,
) -> None:
    """Append one record per request: its id, the last context position before the block
    (``anchors``), the token the block starts from, the drafts, how many of them the
    confidence scheduler sends for verification (``verify``; null: all) and the
    tensor-parallel rank that wrote it. Every rank logs, so that ranks can be compared.
    Copies to the host."""
    rank = get_tensor_model_parallel_rank()
    verify = lengths.tolist() if lengths is not None else [None] * len(req_ids)
    columns = (req_ids, anchors.tolist(), anchor_tokens.tolist(), drafts.tolist(), verify)
    lines = [
        json.dumps(
            {
                "req_id": req_id,
                "anchor": anchor,
                "anchor_token": anchor_token,
                "drafts": block,
                "verify": length,
                "rank": rank,
            }
        )
        + "\n"
        for req_id, anchor, anchor_token, block, length in zip(*columns, strict=True)
    ]
    # One O_APPEND write per step: ranks appending to one file never split each other's lines.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, "".join(lines).encode())
    finally:
        os.close(fd)
