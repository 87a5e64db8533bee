# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The DeepSeek-V4 ring's bytes at the serving profile's `max_num_seqs`, allocated on the device
and compared with the count from its geometry."""

from __future__ import annotations

import argparse

from tools.gpu_selftest.report import FAILED, PASSED, Outcome, cuda_available

# DeepSeek-V4-Flash's ring geometry (its config.json: sliding_window, 3 tapped stages,
# head_dim) and the Spark profile's max_num_seqs (recipe/profiles/deepseek-v4-flash-2x-spark).
V4_FLASH_RING = {"window": 128, "stages": 3, "head_dim": 512}
SPARK_MAX_NUM_SEQS = 6


def check_draft_state(args: argparse.Namespace) -> Outcome:
    import torch

    from vllm.v1.spec_decode.dspark.ring import ContextRing

    device = torch.device("cuda" if cuda_available() else "cpu")
    geometry = V4_FLASH_RING
    num_slots, entries = args.max_num_seqs + 1, (args.max_num_seqs + 1) * geometry["window"] + 1
    # values (bf16), int64 tags and int64 write-scratch ranks, one hidden dump entry each
    expected = entries * (geometry["stages"] * geometry["head_dim"] * 2 + 8 + 8)
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    ring = ContextRing(
        num_slots,
        geometry["window"],
        (geometry["stages"], geometry["head_dim"]),
        torch.bfloat16,
        device,
    )
    buffers = (ring._flat_values, ring._flat_tags, ring._winner_rank)
    counted = sum(t.numel() * t.element_size() for t in buffers)
    facts = {"max_num_seqs": args.max_num_seqs, "bytes": counted, "expected": expected}
    if device.type == "cuda":
        facts["allocated"] = torch.cuda.memory_allocated() - before
    if counted != expected:
        return Outcome(FAILED, f"ring holds {counted} bytes, its geometry gives {expected}", facts)
    return Outcome(
        PASSED,
        f"DeepSeek-V4 ring at max_num_seqs {args.max_num_seqs}: {counted:,d} bytes "
        f"({counted / 2**20:.2f} MiB) on {device.type}, independent of max_model_len",
        facts,
    )
