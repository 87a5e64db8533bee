# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The fused Markov chain (``markov_kernel``) under Triton's interpreter against the plain-torch
chain with vLLM's Markov head: at fp32, the same greedy drafts and embeddings; the same sampled
drafts as vLLM's draft sampler given the kernel's noise, with the same distributions; and
sampled drafts that follow the distributions they return. Both ways positions meet: one launch
a position, and one launch for the chain (one program a tile here, since the interpreter runs
programs one after another; its grid barrier between programs runs only on a GPU).

Triton's interpreter must be on when Triton is first imported (its own library functions are
built then), so the comparison runs in a fresh interpreter with ``TRITON_INTERPRET=1``."""

import functools
import os
import subprocess
import sys

import pytest
import torch

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.models.qwen3_dspark import DSparkMarkovHead
from vllm.v1.sample.ops.topk_topp_sampler import sample_with_exponential_noise
from vllm.v1.sample.sampler import _SAMPLING_EPS
from vllm.v1.spec_decode.dspark import markov
from vllm.v1.spec_decode.dspark.markov import (
    PositionSampler,
    SampledDrafts,
    markov_chain,
    plain_markov_weights,
)

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
    assert "same sampled drafts" in result.stdout, result.stdout[-3000:]
    assert "sampled drafts follow their distributions" in result.stdout, result.stdout[-3000:]
    assert "same drafts in tiles" in result.stdout, result.stdout[-3000:]
    assert "ties keep the first token" in result.stdout, result.stdout[-3000:]
    assert "the whole chain drafts the same" in result.stdout, result.stdout[-3000:]
    assert "a disagreeing whole chain stays off" in result.stdout, result.stdout[-3000:]
    assert "ranks padded for tl.dot draft the same" in result.stdout, result.stdout[-3000:]


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
    compare_sampled(base, anchors, head, bias, weights)
    check_sampled_distribution(head, bias, weights)
    compare_tiles(head, bias, weights)
    check_ties_keep_the_first_token()
    compare_whole_chain(head, bias, weights)
    check_a_disagreeing_whole_chain_stays_off(weights)
    compare_ranks_tl_dot_pads()
    print("same drafts")


def kernel_uniforms(seed: torch.Tensor, rows: int, positions: int, vocab: int) -> torch.Tensor:
    """``[rows, positions, vocab]``: the uniforms the sampled kernel draws under ``seed``."""
    import triton
    import triton.language as tl

    @triton.jit
    def uniforms(seed_ptr, out_ptr, vocab, positions, BLOCK: tl.constexpr):
        r, step = tl.program_id(0), tl.program_id(1)
        v = tl.arange(0, BLOCK)
        u = tl.rand(tl.load(seed_ptr) + r, step * vocab + v)
        tl.store(out_ptr + (r * positions + step) * vocab + v, u, mask=v < vocab)

    out = torch.empty(rows, positions, vocab)
    uniforms[(rows, positions)](seed, out, vocab, positions, BLOCK=triton.next_power_of_2(vocab))
    return out


def vllm_sampler_with_noise(temperature: torch.Tensor, uniforms: torch.Tensor) -> PositionSampler:
    """vLLM's draft sampler (``compute_probs_and_sample_next_token``) at ``temperature`` whose
    exponential noise at position j is ``-log(uniforms[:, j])``."""
    positions = iter(range(uniforms.shape[1]))

    def sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = -torch.log(uniforms[:, next(positions)])
        greedy = temperature < _SAMPLING_EPS
        probs = (logits / torch.where(greedy, 1.0, temperature)[:, None]).softmax(-1)
        tokens = sample_with_exponential_noise(probs.clone(), q)
        return torch.where(greedy, probs.argmax(-1), tokens), probs

    return sample


def sampled_pair(base, anchors, head, bias, weights, temperature, seed: int):
    """``(fused, reference)``: the fused chain's sampled drafts under ``seed``, and the torch
    chain's through vLLM's sampler given the noise the kernels drew."""
    torch.manual_seed(seed)
    fused = markov_chain(
        base,
        anchors,
        head.embed,
        bias,
        sample=SampledDrafts(temperature, lambda rows: pytest.fail("not fused")),
        markov_weights=weights,
    )
    torch.manual_seed(seed)  # the seed the fused chain drew
    uniforms = kernel_uniforms(torch.randint(2**62, (1,)), *base.shape)
    sampler = vllm_sampler_with_noise(temperature, uniforms)
    reference = markov_chain(
        base, anchors, head.embed, bias, sample=SampledDrafts(temperature, lambda rows: sampler)
    )
    assert torch.equal(fused.token_ids, reference.token_ids), (fused.token_ids, reference.token_ids)
    assert fused.probs is not None and reference.probs is not None
    torch.testing.assert_close(fused.probs, reference.probs, rtol=1e-5, atol=1e-7)
    return fused, reference


def compare_sampled(base, anchors, head, bias, weights) -> None:
    """Sampled drafts at temperatures 0 (greedy), 0.8 and 1.3: the kernel's tokens are vLLM's
    sampler's given the kernel's noise, and its distributions are the torch chain's."""
    temperature = torch.tensor([0.0, 0.8, 1.3])
    fused, _ = sampled_pair(base, anchors, head, bias, weights, temperature, seed=5)
    # The noise matters: the sampled rows are not all their argmax.
    assert not torch.equal(fused.token_ids[1:], fused.probs[1:].argmax(-1))
    print("same sampled drafts")


def check_sampled_distribution(head, bias, weights, rows: int = 200) -> None:
    """One position drawn for ``rows`` identical requests over four tokens: the frequencies
    fit the distribution the kernel returns (chi-squared, 3 degrees of freedom, p < 1e-4
    rejects)."""
    vocab = 4
    anchors = torch.full((rows,), 7)
    temperature = torch.full((rows,), 4.0)
    torch.manual_seed(0)
    drafts = markov_chain(
        torch.zeros(rows, 1, vocab),
        anchors,
        head.embed,
        bias,
        sample=SampledDrafts(temperature, lambda rows: pytest.fail("not fused")),
        markov_weights=weights,
    )
    assert drafts.probs is not None
    probs = drafts.probs[0, 0].double()
    assert torch.allclose(drafts.probs, drafts.probs[:1])
    assert probs.max() < 0.6, f"a spread distribution tests the draw: {probs}"
    counts = torch.bincount(drafts.token_ids[:, 0], minlength=vocab).double()
    chi2 = ((counts - rows * probs) ** 2 / (rows * probs)).sum()
    assert chi2 < 21.1, (counts, rows * probs)
    print("sampled drafts follow their distributions")


def compare_tiles(head, bias, weights, batch: int = 33) -> None:
    """Two tiles of requests (32 and 1) over 11 vocabulary blocks reduced 4 at a time: greedy
    and sampled drafts as in ``compare_sampled``, so that the tiles' rows, the blocks and the
    chunks of the block reduction are all where they belong."""
    from vllm.v1.spec_decode.dspark import markov_kernel

    assert markov_kernel.rows_per_program(batch) < batch
    sizes = markov_kernel.BLOCK, markov_kernel.REDUCE_CHUNK
    markov_kernel.BLOCK, markov_kernel.REDUCE_CHUNK = 64, 4
    try:
        g = torch.Generator().manual_seed(3)
        base = 4 * torch.randn(batch, N, VOCAB, generator=g)
        anchors = torch.randint(0, VOCAB, (batch,), generator=g)
        fused = markov_chain(base, anchors, head.embed, bias, markov_weights=weights)
        assert torch.equal(fused.token_ids, markov_chain(base, anchors, head.embed, bias).token_ids)
        temperature = torch.rand(batch, generator=g) + 0.5
        temperature[::5] = 0.0
        sampled_pair(base, anchors, head, bias, weights, temperature, seed=6)
    finally:
        markov_kernel.BLOCK, markov_kernel.REDUCE_CHUNK = sizes
    print("same drafts in tiles")


def check_ties_keep_the_first_token() -> None:
    """Equal best scores in two blocks of different reduction chunks: the first token, as
    ``argmax`` takes it."""
    from vllm.v1.spec_decode.dspark import markov_kernel

    sizes = markov_kernel.BLOCK, markov_kernel.REDUCE_CHUNK
    markov_kernel.BLOCK, markov_kernel.REDUCE_CHUNK = 64, 4
    try:
        w1 = torch.ones(VOCAB, RANK)
        w2 = torch.zeros(VOCAB, RANK)
        base = torch.zeros(1, 2, VOCAB)
        first, second = 100, 600  # blocks 1 and 9: chunks 0 and 2
        base[0, :, [first, second]] = 1.0
        drafts = torch.empty(1, 2, dtype=torch.int64)
        markov_kernel.greedy_markov_chain(base, torch.tensor([0]), w1, w2, drafts)
        assert drafts.tolist() == [[first, first]], drafts
    finally:
        markov_kernel.BLOCK, markov_kernel.REDUCE_CHUNK = sizes
    print("ties keep the first token")


def compare_ranks_tl_dot_pads() -> None:
    """Markov ranks below the 16 columns ``tl.dot`` takes, and one that is no power of two (the
    tiny drafts of the engine tests have rank 8 or 16): greedy drafts as the torch chain's."""
    from torch.nn import functional

    from vllm.v1.spec_decode.dspark import markov_kernel

    g = torch.Generator().manual_seed(4)
    for rank in (8, 24):
        w1, w2 = torch.randn(VOCAB, rank, generator=g), torch.randn(VOCAB, rank, generator=g)
        base = 4 * torch.randn(BATCH, N, VOCAB, generator=g)
        anchors = torch.randint(0, VOCAB, (BATCH,), generator=g)
        drafts = torch.empty(BATCH, N, dtype=torch.int64)
        markov_kernel.greedy_markov_chain(base, anchors, w1, w2, drafts)
        expected = markov_chain(
            base,
            anchors,
            functools.partial(functional.embedding, weight=w1),
            functools.partial(functional.linear, weight=w2),
        )
        assert torch.equal(drafts, expected.token_ids), rank
    print("ranks padded for tl.dot draft the same")


def compare_whole_chain(head, bias, weights) -> None:
    """The one-launch chain, turned on after its own check: ``compare_tiles`` and the ties again,
    now over 4 shares of 11 blocks in one launch."""
    from vllm.v1.spec_decode.dspark import markov_kernel

    cpu = torch.device("cpu")
    assert markov_kernel.use_whole_chain(cpu, 4, *weights) is None
    launches = []
    whole_chain = markov_kernel._whole_chain
    markov_kernel._whole_chain = lambda *args: launches.append(1) or whole_chain(*args)
    try:
        compare_tiles(head, bias, weights)
        check_ties_keep_the_first_token()
    finally:
        markov_kernel._whole_chain = whole_chain
        del markov_kernel._whole_chains[cpu]
    assert len(launches) == 3, launches
    print("the whole chain drafts the same")


def check_a_disagreeing_whole_chain_stays_off(weights) -> None:
    """A one-launch chain that drafts otherwise is not used, and one warning says so."""
    from vllm.v1.spec_decode.dspark import markov_kernel

    whole_chain = markov_kernel._whole_chain

    def wrong(base_logits, anchor_tokens, w1, w2, drafts, *rest) -> None:
        whole_chain(base_logits, anchor_tokens, w1, w2, drafts, *rest)
        drafts[:, -1] += 1

    markov_kernel._whole_chain = wrong
    warnings = []
    warning = markov_kernel.logger.warning
    markov_kernel.logger.warning = lambda *args: warnings.append(args[0] % args[1:])
    try:
        off = markov_kernel.use_whole_chain(torch.device("cpu"), 4, *weights)
    finally:
        markov_kernel._whole_chain = whole_chain
        markov_kernel.logger.warning = warning
    assert torch.device("cpu") not in markov_kernel._whole_chains
    assert off == "other drafts at batch 1, greedy", off
    assert len(warnings) == 1 and off in warnings[0], warnings
    print("a disagreeing whole chain stays off")


def test_a_scaled_or_capped_bias_is_not_fused():
    head, logits = markov_head(seed=2)
    logits.scale = 0.5
    assert plain_markov_weights(head, logits) is None
    logits.scale, logits.soft_cap = 1.0, 30.0
    assert plain_markov_weights(head, logits) is None


if __name__ == "__main__":
    compare_interpreted_with_torch()
