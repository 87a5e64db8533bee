# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The fused greedy Markov chain (``markov_kernel``) under Triton's interpreter against the
plain-torch chain with vLLM's Markov head: the same drafts and embeddings at fp32.

Triton's interpreter must be on when Triton is first imported (its own library functions are
built then), so the comparison runs in a fresh interpreter with ``TRITON_INTERPRET=1``."""

import os
import subprocess
import sys

import pytest
import torch

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.models.qwen3_dspark import DSparkMarkovHead
from vllm.v1.spec_decode.dspark import markov
from vllm.v1.spec_decode.dspark.markov import markov_chain, plain_markov_weights

VOCAB, RANK, N, BATCH = 700, 32, 4, 3


def markov_head(seed: int) -> tuple[DSparkMarkovHead, LogitsProcessor]:
    g = torch.Generator().manual_seed(seed)
    with set_current_vllm_config(VllmConfig()):
        head = DSparkMarkovHead(VOCAB, VOCAB, RANK, prefix="markov_head")
        logits = LogitsProcessor(VOCAB)
    head.markov_w1.weight.data = torch.randn(VOCAB, RANK, generator=g)
    weight = head.markov_w2.weight  # padded to a multiple of 64 rows by vLLM
    weight.data.copy_(torch.randn(tuple(weight.shape), generator=g))
    head.markov_w2.quant_method.process_weights_after_loading(head.markov_w2)
    return head, logits


@pytest.mark.multiproc  # reruns itself in a subprocess under Triton's interpreter
def test_fused_greedy_chain_drafts_what_the_torch_chain_does():
    result = subprocess.run(
        [sys.executable, __file__],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("same drafts"), result.stdout[-3000:]


def compare_interpreted_with_torch() -> None:
    """In a process started with ``TRITON_INTERPRET=1``: the chain through the interpreted kernels
    and through vLLM's head in torch."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from vllm.v1.spec_decode.dspark import markov_kernel

    markov.fused_kernels_run_on = lambda tensor: True
    head, logits = markov_head(seed=0)
    weights = plain_markov_weights(head, logits)
    assert weights is not None
    g = torch.Generator().manual_seed(1)
    base = 4 * torch.randn(BATCH, N, VOCAB, generator=g)
    anchors = torch.randint(0, VOCAB, (BATCH,), generator=g)

    def bias(embed: torch.Tensor) -> torch.Tensor:
        return head.bias(embed, logits)

    torch_chain = markov_chain(base, anchors, head.embed, bias)
    calls = []
    launch = markov_kernel.greedy_markov_chain
    markov_kernel.greedy_markov_chain = lambda *args: calls.append(1) or launch(*args)
    fused = markov_chain(base, anchors, head.embed, bias, markov_weights=weights)
    assert calls, "the fused kernels did not run"
    assert torch.equal(fused.token_ids, torch_chain.token_ids)
    assert fused.markov_embeds is not None and torch_chain.markov_embeds is not None
    assert torch.equal(fused.markov_embeds, torch_chain.markov_embeds)
    # The bias matters: the chain does not just take each position's base argmax.
    assert not torch.equal(fused.token_ids, base.argmax(-1))
    without = markov_chain(
        base, anchors, head.embed, bias, markov_weights=weights, with_embeds=False
    )
    assert without.markov_embeds is None and torch.equal(without.token_ids, fused.token_ids)
    print("same drafts")


def test_a_scaled_or_capped_bias_is_not_fused():
    head, logits = markov_head(seed=2)
    logits.scale = 0.5
    assert plain_markov_weights(head, logits) is None
    logits.scale, logits.soft_cap = 1.0, 30.0
    assert plain_markov_weights(head, logits) is None


if __name__ == "__main__":
    compare_interpreted_with_torch()
