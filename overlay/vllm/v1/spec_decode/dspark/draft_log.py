# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``dspark_draft_log``: every step's drafts per request, one JSON line each (debug only).

A debug option never takes a server down: start-up opens the file and writes a start record
(``options.check_draft_log``), so a path that cannot take a write refuses the configuration,
and a write that fails later (a full disk, an I/O error, the file replaced by a directory)
turns the log off with one warning while serving goes on.
"""

import errno
import json
import os
import time

import torch

from vllm.distributed import get_tensor_model_parallel_rank
from vllm.logger import init_logger

logger = init_logger(__name__)


def append_records(path: str, records: list[dict]) -> None:
    """Append ``records`` as JSON lines in one ``O_APPEND`` write, so that ranks appending to
    one file never split each other's lines; a short write raises like a failed one."""
    data = "".join(json.dumps(record) + "\n" for record in records).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
    finally:
        os.close(fd)
    if written != len(data):
        raise OSError(errno.EIO, f"wrote {written} of {len(data)} bytes")


def start_record() -> dict:
    """What start-up writes first: where one engine's records begin in an appended file."""
    return {"event": "start", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid()}


class DraftLog:
    """The proposer's handle on ``dspark_draft_log``, off for good after a failed write."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.enabled = True

    def append(
        self,
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
        if not self.enabled:
            return
        rank = get_tensor_model_parallel_rank()
        verify = lengths.tolist() if lengths is not None else [None] * len(req_ids)
        columns = (req_ids, anchors.tolist(), anchor_tokens.tolist(), drafts.tolist(), verify)
        records = [
            {
                "req_id": req_id,
                "anchor": anchor,
                "anchor_token": anchor_token,
                "drafts": block,
                "verify": length,
                "rank": rank,
            }
            for req_id, anchor, anchor_token, block, length in zip(*columns, strict=True)
        ]
        try:
            append_records(self.path, records)
        except OSError as error:
            self.enabled = False
            logger.warning(
                "dspark_draft_log=%r cannot be written (%s): the draft log is off from now "
                "on; serving goes on.",
                self.path,
                error.strerror or error,
            )
