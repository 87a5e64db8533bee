# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""vLLM's `ops.rms_norm` with a stacked `[L, head_dim]` weight, the one fused call with which
upstream's Qwen3 DFlash draft (and so DSpark's Qwen3 drafts) normalise every layer's context keys,
each with its own layer's `k_norm` weight. The project's `qwen3-dflash.patch` loops per layer off
CUDA (vLLM's CPU kernel applies row 0 to every row) and keeps the fused call on CUDA, so on CUDA a
kernel that does not index the weight by row gives every draft layer layer 0's `k_norm`: the
drafts are silently worse, and the check fails.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from tools.gpu_selftest.report import FAILED, PASSED, Outcome, cuda_available

INDEXED = "stacked weight indexed by row"
ROW_ZERO = "stacked weight not indexed by row (row 0 for every layer)"


def rms_norm_verdict(device_type: str, matches_per_layer: bool, matches_row_zero: bool) -> Outcome:
    """The check's outcome for what the stacked call matched on `device_type`."""
    if matches_per_layer:
        fact = f"{device_type}: {INDEXED}"
        return Outcome(PASSED, f"contract fact: {fact}", {"contract": fact})
    if not matches_row_zero:
        return Outcome(
            FAILED, f"{device_type}: stacked rms_norm matches neither a per-layer loop nor row 0"
        )
    fact = f"{device_type}: {ROW_ZERO}"
    if device_type == "cuda":
        return Outcome(
            FAILED,
            f"{fact}: every Qwen3 DSpark/DFlash draft layer would normalise its context keys with "
            "layer 0's k_norm (qwen3-dflash.patch keeps the fused call on CUDA); normalise per "
            "layer on CUDA too before serving Qwen3 drafts",
            {"contract": fact},
        )
    return Outcome(
        PASSED,
        f"contract fact: {fact}; qwen3-dflash.patch normalises per layer off CUDA",
        {"contract": fact},
    )


def check_rms_norm(args: argparse.Namespace) -> Outcome:
    import torch

    from vllm import _custom_ops as ops

    device = torch.device("cuda" if cuda_available() else "cpu")
    layers, contexts, heads, head_dim, eps = 4, 5, 2, 64, 1e-6
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(layers, contexts, heads, head_dim, generator=generator).to(
        device, torch.bfloat16
    )
    weight = (1 + torch.rand(layers, head_dim, generator=generator)).to(device, torch.bfloat16)
    stacked = torch.empty_like(x)
    ops.rms_norm(stacked, x, weight, eps)

    def loop(row_of_layer: Callable[[int], int]) -> torch.Tensor:
        out = torch.empty_like(x)
        for layer in range(layers):
            ops.rms_norm(
                out[layer], x[layer].contiguous(), weight[row_of_layer(layer)].contiguous(), eps
            )
        return out

    def close(a, b) -> bool:
        return torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)

    per_layer, row_zero = loop(lambda layer: layer), loop(lambda layer: 0)
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    reference = normed * weight.float().view(layers, 1, 1, head_dim)
    if not close(per_layer, reference):
        return Outcome(FAILED, f"{device.type}: rms_norm differs from RMSNorm even per layer")
    return rms_norm_verdict(device.type, close(stacked, per_layer), close(stacked, row_zero))
