# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""FLOPs, bytes and a modelled time of one draft step at the real sizes of the shipped drafts.

The tiny engines of ``draft_step_cost`` count launches; FLOPs and bytes depend on the sizes, so
they are computed here from the shapes of each shipped draft: DeepSpec's Qwen3-8B block-7 draft
(paged) and DeepSeek-V4-Flash's ``mtp`` draft (ring), each against its baseline: upstream DFlash
for the paged family (``k + 1`` queries per request, no Markov chain, no confidence head), the
same three stages without the Markov chain and confidence head for the ring family (vLLM has no
DFlash of DeepSeek-V4).

Per step and GEMM, FLOPs are ``2 T K N`` and bytes the weight read once plus its activations;
attention reads each request's context K/V (``--context`` tokens). What DSpark adds: per draft
position the Markov bias (``W1`` rows, ``W2 [r, V]`` read in full once per tile of up to 32
requests, the base-logit row read and the biased row written), its sampling and the confidence
head. Each kernel is counted unfused, except what vLLM fuses on CUDA (its custom ops,
``draft_step_cost``'s launch mapping).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    """Peak figures of a GPU, for a roofline time: ``max(bytes / bandwidth, FLOPs / peak)``
    per step, plus ``launch_us`` per eager launch and ``graph_kernel_us`` per kernel replayed in
    a CUDA graph."""

    name: str
    bandwidth: float
    """Bytes per second of device memory."""
    bf16_flops: float
    """Dense BF16 tensor-core FLOPs per second."""
    launch_us: float = 5.0
    graph_kernel_us: float = 1.0


# Memory bandwidth as NVIDIA's spec sheets give it; the dense BF16 peak as their sparse FP4
# figure / 8 (sparsity, FP4 -> FP8 -> BF16: 1 PFLOP for GB10, 18 for B200, 4 for RTX PRO 6000
# Blackwell). The launch latencies are this model's parameters, not measured here.
DEVICES = (
    Device("GB10", bandwidth=273e9, bf16_flops=125e12),
    Device("B200", bandwidth=8e12, bf16_flops=2.25e15),
    Device("RTX PRO 6000", bandwidth=1.792e12, bf16_flops=0.5e15),
)


@dataclass(frozen=True)
class Geometry:
    """The shapes of one shipped draft that its step's FLOPs and bytes depend on."""

    hidden: int
    vocab: int
    layers: int
    """Decoder layers (paged) or stages (ring)."""
    taps: int
    """Target layers whose hidden states are combined per context token."""
    markov_rank: int
    block: int
    """The trained block: DSpark queries all of it."""
    q_dim: int
    kv_dim: int
    attention_weights: int
    """Elements of one layer's attention projections (query, key/value, output)."""
    mlp_dense_bytes: float
    """Weight bytes of one layer's MLP read whatever the tokens (a dense MLP, a shared expert)."""
    mlp_flops_per_token: float
    expert_bytes: float = 0.0
    """Weight bytes of one routed expert (a MoE)."""
    experts: int = 0
    experts_per_token: int = 0
    mlp_flops_per_token: float
    linear_bytes: float = 2.0
    """Bytes per weight element of the attention projections."""


def _qwen3_8b() -> Geometry:
    hidden, intermediate = 4096, 12288
    return Geometry(
        hidden=hidden,
        vocab=151936,
        layers=5,
        taps=5,
        markov_rank=256,
        block=7,
        q_dim=32 * 128,
        kv_dim=8 * 128,
        attention_weights=hidden * (32 * 128 + 2 * 8 * 128) + 32 * 128 * hidden,
        mlp_dense_bytes=3 * hidden * intermediate * 2,
        mlp_flops_per_token=2 * 3 * hidden * intermediate,
    )


def _deepseek_v4_flash() -> Geometry:
    """``mtp.*``: three stages of MQA (one 512-wide KV head, low-rank Q and O) and a MoE of 256
    MXFP4 experts (top 6, intermediate 2048) plus one FP8 shared expert, FP8 projections; the
    shapes of the checkpoint's config (docs/deepseek-v4.md)."""
    hidden, inter, top = 4096, 2048, 6
    return Geometry(
        hidden=hidden,
        vocab=129280,
        layers=3,
        taps=3,
        markov_rank=256,
        block=5,
        q_dim=64 * 512,
        kv_dim=512,
        # wq_a, wq_b, wkv, wo_a (8 groups of 4096 -> 1024), wo_b.
        attention_weights=hidden * 1024
        + 1024 * 64 * 512
        + hidden * 512
        + 64 * 512 * 1024
        + 8 * 1024 * hidden,
        mlp_dense_bytes=3 * hidden * inter * 1.0,  # the FP8 shared expert
        mlp_flops_per_token=2 * 3 * hidden * inter * (top + 1),
        expert_bytes=3 * hidden * inter * 0.5,  # MXFP4, scales left out
        experts=256,
        experts_per_token=top,
        linear_bytes=1.0,
    )


GEOMETRIES = {"paged": _qwen3_8b(), "ring": _deepseek_v4_flash()}


@dataclass
class StepCost:
    flops: float = 0.0
    weight_bytes: float = 0.0
    activation_bytes: float = 0.0

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.activation_bytes

    def gemm(self, tokens: int, k: int, n: int, weight_element: float = 2.0) -> None:
        self.flops += 2 * tokens * k * n
        self.weight_bytes += k * n * weight_element
        self.activation_bytes += 2 * tokens * (k + n)


def _mlp_bytes(g: Geometry, tokens: int) -> float:
    """Weight bytes one layer's MLP reads for ``tokens`` tokens: the dense part, and the routed
    experts the tokens pick (the expected number of distinct ones under uniform routing)."""
    if not g.experts:
        return g.mlp_dense_bytes
    touched = g.experts * (1 - (1 - g.experts_per_token / g.experts) ** tokens)
    return g.mlp_dense_bytes + touched * g.expert_bytes


def step_cost(
    g: Geometry,
    k: int,
    batch: int,
    dspark: bool,
    sampled: bool,
    confidence: bool,
    context: int,
    topk: int | None = None,
) -> StepCost:
    """One draft step of ``batch`` requests decoding, ``k`` drafts each, every draft accepted
    (``k + 1`` new context tokens per request). ``topk``: DSpark's candidate pruning
    (``dspark_draft_topk``): the Markov bias only for each position's ``topk`` largest base
    logits, its ``W2`` columns gathered instead of read in full. Without it DSpark's chain is
    ``markov_kernel``'s fused kernels: the bias and the draw stay in registers."""
    cost = StepCost()
    queries = (g.block if dspark else k + 1) * batch
    new_context = (k + 1) * batch
    h = g.hidden
    # The new context tokens' target features, combined, then each layer's context K/V.
    cost.gemm(new_context, g.taps * h, h, g.linear_bytes)
    for _ in range(g.layers):
        cost.gemm(new_context, h, 2 * g.kv_dim, g.linear_bytes)
        cost.flops += 2 * queries * g.attention_weights
        cost.weight_bytes += g.attention_weights * g.linear_bytes
        cost.activation_bytes += 2 * queries * (2 * h + g.q_dim) * 2
        # Attention: every query reads its request's context K/V (bf16).
        cost.flops += 4 * queries * context * g.q_dim
        cost.activation_bytes += batch * context * 2 * g.kv_dim * 2
        cost.flops += queries * g.mlp_flops_per_token
        cost.weight_bytes += _mlp_bytes(g, queries)
        cost.activation_bytes += 2 * queries * h * 4
    # Base logits of the k verified positions (bf16 lm_head, float32 logits).
    rows = batch * k
    cost.flops += 2 * rows * h * g.vocab
    cost.weight_bytes += h * g.vocab * 2
    cost.activation_bytes += rows * (h * 2 + g.vocab * 4)
    logit_rows = rows * g.vocab * 4
    fused = dspark and topk is None
    if fused:
        # Each position's base row read once; sampled: its scaled logits written, then read
        # and rewritten as the distribution.
        cost.activation_bytes += (4 if sampled else 1) * logit_rows
    elif sampled:
        # vLLM's draft sampler: temperature, softmax, the exponential race, argmax; about
        # six passes over the float32 logits, and the distributions written.
        cost.activation_bytes += 7 * logit_rows
    else:
        cost.activation_bytes += logit_rows  # argmax
    if dspark:
        r = g.markov_rank
        columns = g.vocab if topk is None else batch * topk
        if topk is not None:
            cost.activation_bytes += logit_rows  # the top-k of the base logits, once
        # The fused kernels read W2 once per tile of requests, the GEMMs of the top-k chain once.
        # (Imported here: Model Runner V2's lane counts its steps with this module and must not
        # import the overlay.)
        from vllm.v1.spec_decode.dspark.markov_kernel import rows_per_program

        w2_reads = math.ceil(batch / rows_per_program(batch)) if fused else 1
        for _ in range(k):
            cost.weight_bytes += batch * r * 2 + w2_reads * r * columns * 2  # W1 rows, W2
            cost.flops += 2 * batch * r * min(columns, g.vocab)
            if not fused:
                # bias written, base row and bias read, biased row written (then sampled above).
                cost.activation_bytes += batch * g.vocab * 4 * 4
        if confidence:
            cost.gemm(rows, h + r, 1)
    return cost


def launch_time_us(device: Device, graph_launches: int, eager_launches: int) -> float:
    return graph_launches * device.graph_kernel_us + eager_launches * device.launch_us


def modelled_us(device: Device, cost: StepCost, graph_launches: int, eager_launches: int) -> float:
    """Launch latency plus the roofline of the bytes and FLOPs."""
    roofline = max(cost.bytes / device.bandwidth, cost.flops / device.bf16_flops)
    return launch_time_us(device, graph_launches, eager_launches) + roofline * 1e6


def markov_w2_bytes(g: Geometry, k: int) -> float:
    """``W2`` read in full once per draft position."""
    return k * g.markov_rank * g.vocab * 2
