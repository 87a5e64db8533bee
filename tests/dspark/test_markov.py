# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The Markov chain: top-k exactness, probabilistic drafts, and losslessness with vLLM's rejection
sampler at temperature > 0."""

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.models.qwen3_dspark import DSparkMarkovHead
from vllm.platforms import current_platform
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import rejection_sample
from vllm.v1.spec_decode.dspark.cudagraph import FixedTemperatureSampler
from vllm.v1.spec_decode.dspark.markov import SampledDrafts, greedy_sample, markov_chain
from vllm.v1.spec_decode.dspark.proposer_base import DSparkProposerMixin
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels():
    """The rejection sampler's kernels as a V1 worker registers them on this platform (vLLM's
    C++ implementations when Triton is absent)."""
    current_platform.register_triton_kernel_overrides()


def draft_sampler_proposer(probabilistic: bool) -> SimpleNamespace:
    """What vLLM's draft sampler (``_sample_from_logits``) reads of a proposer."""
    proposer = SimpleNamespace(
        options=SimpleNamespace(probabilistic=probabilistic),
        _enable_probabilistic_draft_probs=probabilistic,
        use_fp64_gumbel=False,
    )
    proposer._sample_from_logits = partial(SpecDecodeBaseProposer._sample_from_logits, proposer)
    return proposer


def position_sampler(probabilistic: bool, metadata: SamplingMetadata):
    """The proposers' per-position sampler off the fused kernels: vLLM's ``_sample_from_logits``
    (greedy_sample for greedy drafts or all-greedy batches)."""
    proposer = draft_sampler_proposer(probabilistic)
    sample = DSparkProposerMixin._position_sampler(proposer, metadata)
    if isinstance(sample, SampledDrafts):
        return sample.position_sampler(metadata.temperature.shape[0])
    return sample


def graph_sampler(metadata: SamplingMetadata) -> FixedTemperatureSampler:
    """The sampler a sampled draft graph captures: vLLM's draft sampler over the fixed
    temperature buffer, written from ``metadata`` as before a replay (no padding rows)."""
    assert metadata.temperature is not None
    rows = metadata.temperature.shape[0]
    proposer = draft_sampler_proposer(True)
    sampler = FixedTemperatureSampler(proposer._sample_from_logits, rows, torch.device("cpu"))
    sampler.write(metadata, rows, rows)
    return sampler.begin(rows)


def sampling_metadata(temperature: torch.Tensor) -> SamplingMetadata:
    greedy = temperature == 0
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=bool(greedy.all()),
        all_random=not bool(greedy.any()),
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(0),
        presence_penalties=torch.zeros(0),
        repetition_penalties=torch.zeros(0),
        output_token_ids=[],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


# --- top-k (dspark_draft_topk) against the full computation, with vLLM's Markov head ------------


class Heads:
    """vLLM's DSparkMarkovHead, as the proposer uses it. Dyadic weights and logits keep every
    rank-r sum exact in float32, so the full and gathered products agree bit for bit."""

    def __init__(self, vocab: int, rank: int, seed: int, w1=None, w2=None) -> None:
        g = torch.Generator().manual_seed(seed)
        with set_current_vllm_config(VllmConfig()):
            self.head = DSparkMarkovHead(vocab, vocab, rank, prefix="markov_head")
            self.logits = LogitsProcessor(vocab)
        if w1 is None:
            w1 = torch.randint(-4, 5, (vocab, rank), generator=g) / 4.0
        self.head.markov_w1.weight.data = w1
        weight = self.head.markov_w2.weight  # padded to a multiple of 64 rows by vLLM
        if w2 is None:
            w2 = torch.randint(-4, 5, tuple(weight.shape), generator=g) / 4.0
        weight.data.zero_()
        weight.data[: w2.shape[0]] = w2
        # As the proposer's load does: the CPU linear path is set up from the loaded weight.
        self.head.markov_w2.quant_method.process_weights_after_loading(self.head.markov_w2)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head.embed(tokens)

    def bias(self, embed: torch.Tensor) -> torch.Tensor:
        return self.head.bias(embed, self.logits)


def dyadic_logits(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(-16, 17, shape, generator=torch.Generator().manual_seed(seed)) / 4.0


def chains(heads: Heads, base: torch.Tensor, anchors: torch.Tensor, topk: int):
    full = markov_chain(base.clone(), anchors, heads.embed, heads.bias)
    top = markov_chain(
        base.clone(),
        anchors,
        heads.embed,
        heads.bias,
        topk=topk,
        markov_bias_gathered=heads.head.apply_bias_gathered,
    )
    return full, top


def test_topk_equals_the_full_chain_whenever_the_true_argmax_is_a_candidate():
    vocab, rank, n, batch, topk = 97, 4, 5, 400, 4
    heads = Heads(vocab, rank, seed=0)
    base = dyadic_logits((batch, n, vocab), seed=1)
    anchors = torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(2))
    full, top = chains(heads, base, anchors, topk)

    candidates = base.topk(topk, dim=-1).indices  # [B, n, topk]
    in_topk = (candidates == full.token_ids.unsqueeze(-1)).any(-1)  # full argmax is a candidate
    covered = in_topk.all(dim=1)
    same = (full.token_ids == top.token_ids).all(dim=1)
    # Every request whose full-chain argmaxes were all candidates drafts exactly the same tokens.
    assert torch.equal(same[covered], torch.ones_like(same[covered]))
    # Both kinds of request occur, and the uncovered ones do differ: top-k is not a no-op.
    assert 0 < int(covered.sum()) < batch
    assert not same[~covered].all()
    # The Markov embeddings (the confidence head's input) follow the same tokens.
    assert torch.equal(full.markov_embeds[covered], top.markov_embeds[covered])


def test_topk_of_the_whole_vocabulary_is_the_full_chain():
    heads = Heads(31, 4, seed=3)
    base = dyadic_logits((64, 4, 31), seed=4)
    anchors = torch.arange(64) % 31
    full, top = chains(heads, base, anchors, topk=31)
    assert torch.equal(full.token_ids, top.token_ids)


def test_topk_misses_an_argmax_outside_the_candidates():
    """The case the exactness condition excludes: the Markov bias lifts a token whose base
    logit is not among the top k above every candidate. Top-k cannot pick it."""
    w1 = torch.zeros(8, 2)
    w1[:, 0] = 1.0  # every previous token embeds to (1, 0)
    w2 = torch.zeros(8, 2)
    w2[7, 0] = 10.0  # the bias favours token 7 by 10
    heads = Heads(8, 2, seed=5, w1=w1, w2=w2)
    base = torch.tensor([[[4.0, 3.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0]]])
    full, top = chains(heads, base, torch.tensor([0]), topk=2)
    assert full.token_ids.tolist() == [[7]]  # 0 + 10 beats 4
    assert top.token_ids.tolist() == [[0]]  # 7 is not among the top-2 base logits


# --- probabilistic drafts -------------------------------------------------------------------------

VOCAB, RANK, K = 5, 2, 3
TEMPERATURE = 0.8


class PlainHeads:
    """A rank-2 Markov head as plain tensors, for the statistical tests."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.w1 = torch.randn(VOCAB, RANK, generator=g)
        self.w2 = 1.5 * torch.randn(VOCAB, RANK, generator=g)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.w1[tokens]

    def bias(self, embed: torch.Tensor) -> torch.Tensor:
        return embed @ self.w2.T


def test_probabilistic_drafts_return_the_distribution_of_each_drawn_token():
    heads = PlainHeads()
    batch = 6
    base = torch.randn(batch, K, VOCAB, generator=torch.Generator().manual_seed(8))
    anchors = torch.arange(batch) % VOCAB
    temperature = torch.tensor([TEMPERATURE, 1.0, 0.0, 0.5, TEMPERATURE, 2.0])
    sample = position_sampler(True, sampling_metadata(temperature))
    drafts = markov_chain(base.clone(), anchors, heads.embed, heads.bias, sample=sample)
    assert drafts.probs is not None and drafts.probs.shape == (batch, K, VOCAB)
    previous = anchors
    for j in range(K):
        logits = base[:, j] + heads.bias(heads.embed(previous))
        # Greedy rows of a mixed batch take the argmax (their probabilities are unused).
        greedy_row = 2
        assert drafts.token_ids[greedy_row, j] == logits[greedy_row].argmax()
        random_rows = [0, 1, 3, 4, 5]
        expected = (logits[random_rows] / temperature[random_rows, None]).softmax(-1)
        torch.testing.assert_close(drafts.probs[random_rows, j], expected)
        previous = drafts.token_ids[:, j]


@pytest.mark.parametrize(
    "temperature",
    [[TEMPERATURE, 1.0, 0.5, 2.0], [TEMPERATURE, 0.0, 1.0, 0.0]],
    ids=["all sampled", "greedy and sampled"],
)
def test_the_graph_sampler_draws_what_vllms_sampler_draws_from_the_same_random_numbers(
    temperature,
):
    """The sampled graph's sampler (fixed temperature buffer, vLLM's general path for every
    batch) and the eager step's (vLLM's sampler on the batch's own metadata), from the same
    generator state: the same drafts and distributions, greedy rows by argmax."""
    heads = PlainHeads()
    base = torch.randn(4, K, VOCAB, generator=torch.Generator().manual_seed(13))
    anchors = torch.arange(4) % VOCAB
    metadata = sampling_metadata(torch.tensor(temperature))
    drafts = {}
    for path, sample in (
        ("eager", position_sampler(True, metadata)),
        ("graph", graph_sampler(metadata)),
    ):
        torch.manual_seed(14)
        drafts[path] = markov_chain(base.clone(), anchors, heads.embed, heads.bias, sample=sample)
    assert torch.equal(drafts["graph"].token_ids, drafts["eager"].token_ids)
    assert torch.equal(drafts["graph"].probs, drafts["eager"].probs)
    torch.manual_seed(15)
    redrawn = markov_chain(base.clone(), anchors, heads.embed, heads.bias, sample=sample)
    assert not torch.equal(redrawn.token_ids, drafts["graph"].token_ids)  # the draws are random


def test_the_graph_sampler_takes_the_argmax_of_each_greedy_row_of_a_mixed_batch():
    """The greedy rows the graph sampler marks once a block draw what vLLM's sampler draws for
    them at every position: the argmax, not a sample at temperature 1."""
    rows = 64
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(16))
    temperature = torch.tensor([0.0, TEMPERATURE] * (rows // 2))
    metadata = sampling_metadata(temperature)
    drawn = {}
    for path, sample in (
        ("eager", position_sampler(True, metadata)),
        ("graph", graph_sampler(metadata)),
    ):
        torch.manual_seed(17)
        drawn[path] = sample(logits.clone())
    assert torch.equal(drawn["graph"][0], drawn["eager"][0])
    assert torch.equal(drawn["graph"][1], drawn["eager"][1])
    assert torch.equal(drawn["graph"][0][::2], logits[::2].argmax(-1))


def test_probabilistic_drafts_write_into_the_one_preallocated_buffer():
    """The distributions land in the proposer's ``[max_num_seqs, k, V]`` buffer (rows past the
    batch untouched), the same values as without it, and the chain stacks no k tensors: one
    [B, V] distribution at a time is alive besides the buffer."""
    heads = PlainHeads()
    batch, max_batch = 3, 5
    base = torch.randn(batch, K, VOCAB, generator=torch.Generator().manual_seed(10))
    anchors = torch.arange(batch)
    temperature = torch.full((batch,), TEMPERATURE)

    def sample_seeded():
        # Reseeded: both chains draw the same tokens.
        torch.manual_seed(0)
        return position_sampler(True, sampling_metadata(temperature))

    unbuffered = markov_chain(
        base.clone(), anchors, heads.embed, heads.bias, sample=sample_seeded()
    )
    buffer = torch.full((max_batch, K, VOCAB), -1.0)
    stacked = []
    original_stack = torch.stack

    def recording_stack(tensors, *args, **kwargs):
        stacked.append(tuple(tensors[0].shape))
        return original_stack(tensors, *args, **kwargs)

    torch.stack = recording_stack
    try:
        drafts = markov_chain(
            base.clone(),
            anchors,
            heads.embed,
            heads.bias,
            sample=sample_seeded(),
            probs_out=buffer,
        )
    finally:
        torch.stack = original_stack
    assert drafts.probs is not None and drafts.probs.data_ptr() == buffer.data_ptr()
    assert drafts.probs.shape == (batch, K, VOCAB)
    assert torch.equal(drafts.token_ids, unbuffered.token_ids)
    torch.testing.assert_close(drafts.probs, unbuffered.probs)
    assert bool((buffer[batch:] == -1).all())
    assert (batch, VOCAB) not in stacked


def test_drafts_are_written_into_a_given_buffer():
    """A draft graph's fixed ``[max requests, k]`` output: the chain's drafts land in its first
    rows, the rest untouched."""
    heads = PlainHeads()
    batch = 3
    base = torch.randn(batch, K, VOCAB, generator=torch.Generator().manual_seed(11))
    anchors = torch.arange(batch)
    fresh = markov_chain(base, anchors, heads.embed, heads.bias)
    buffer = torch.full((batch + 2, K), -1)
    drafts = markov_chain(base, anchors, heads.embed, heads.bias, drafts_out=buffer)
    assert drafts.token_ids.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:batch], fresh.token_ids)
    assert bool((buffer[batch:] == -1).all())


def test_greedy_method_or_greedy_batches_keep_argmax_drafts_without_probabilities():
    heads = PlainHeads()
    base = torch.randn(4, K, VOCAB, generator=torch.Generator().manual_seed(9))
    anchors = torch.tensor([0, 1, 2, 3])
    greedy = markov_chain(base.clone(), anchors, heads.embed, heads.bias)
    for sampler in (
        position_sampler(False, sampling_metadata(torch.full((4,), TEMPERATURE))),
        position_sampler(True, sampling_metadata(torch.zeros(4))),
    ):
        assert sampler is greedy_sample
        drafts = markov_chain(base.clone(), anchors, heads.embed, heads.bias, sample=sampler)
        assert drafts.probs is None
        assert torch.equal(drafts.token_ids, greedy.token_ids)


# --- losslessness: drafts + vLLM's rejection sampler reproduce the target's distribution ----------

NUM_ROWS = 40_000
# Chi-square bound: dof + 6 sqrt(2 dof) (6 standard deviations of the chi-square under the null;
# a one-sided normal tail of 1e-9). Seeds are fixed, so the test is deterministic.


def chi_square_bound(dof: int) -> float:
    return dof + 6 * (2 * dof) ** 0.5


def target_transition_logits() -> torch.Tensor:
    """The target is a Markov chain over VOCAB tokens: p(next | previous) = softmax(row / T)."""
    return 2.0 * torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(10))


def run_speculative_step(sample) -> torch.Tensor:
    """One speculative step for NUM_ROWS independent requests, all anchored at token 0: DSpark
    drafts K tokens with ``sample``, vLLM's rejection sampler verifies them against the Markov
    target. Returns the emitted tokens ``[NUM_ROWS, K + 1]`` (-1 past the end)."""
    torch.manual_seed(11)
    heads = PlainHeads()
    base = torch.randn(K, VOCAB, generator=torch.Generator().manual_seed(12))
    anchors = torch.zeros(NUM_ROWS, dtype=torch.int64)
    drafts = markov_chain(
        base.expand(NUM_ROWS, K, VOCAB).clone(), anchors, heads.embed, heads.bias, sample=sample
    )
    transition = target_transition_logits() / TEMPERATURE
    previous = torch.cat([anchors[:, None], drafts.token_ids], dim=1)  # [N, K + 1]
    target_logits = transition[previous[:, :K]].reshape(NUM_ROWS * K, VOCAB).contiguous()
    bonus = torch.multinomial(transition[previous[:, K]].softmax(-1), 1).to(torch.int32)
    metadata = sampling_metadata(torch.full((NUM_ROWS,), TEMPERATURE))
    probs = None if drafts.probs is None else drafts.probs.reshape(NUM_ROWS * K, VOCAB)
    return rejection_sample(
        drafts.token_ids.reshape(-1).to(torch.int32).contiguous(),
        [K] * NUM_ROWS,
        K,
        torch.arange(1, NUM_ROWS + 1, dtype=torch.int32) * K,
        None if probs is None else probs.contiguous(),
        target_logits,
        bonus.contiguous(),
        metadata,
    )


def transition_chi_square(emitted: torch.Tensor) -> tuple[float, int]:
    """Pearson chi-square of every emitted (previous, next) pair, the anchor included, against
    the target's transition probabilities."""
    p = (target_transition_logits() / TEMPERATURE).softmax(-1).double()
    anchors = torch.zeros(emitted.shape[0], 1, dtype=emitted.dtype)
    sequence = torch.cat([anchors, emitted], dim=1).long()
    valid = sequence[:, 1:] >= 0
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    counts.index_put_(
        (sequence[:, :-1][valid], sequence[:, 1:][valid]),
        torch.ones(int(valid.sum()), dtype=torch.float64),
        accumulate=True,
    )
    seen = counts.sum(dim=1) > 0  # previous tokens that occurred
    expected = counts.sum(dim=1, keepdim=True) * p
    chi2 = float(((counts - expected)[seen] ** 2 / expected[seen]).sum())
    return chi2, int(seen.sum()) * (VOCAB - 1)


@pytest.mark.parametrize("path", ["eager", "graph"])
def test_probabilistic_drafts_reproduce_the_target_distribution(path):
    """Through vLLM's sampler as the eager step calls it, and through the sampler a sampled
    draft graph captures (temperatures from the fixed buffer)."""
    metadata = sampling_metadata(torch.full((NUM_ROWS,), TEMPERATURE))
    sample = position_sampler(True, metadata) if path == "eager" else graph_sampler(metadata)
    emitted = run_speculative_step(sample)
    chi2, dof = transition_chi_square(emitted)
    assert chi2 < chi_square_bound(dof), (chi2, dof)
    # Drafts are accepted beyond the first position, so the test exercises the chain.
    assert (emitted[:, 2] >= 0).float().mean() > 0.1


def test_greedy_drafts_also_reproduce_the_target_distribution():
    # Greedy drafts carry no probabilities; vLLM treats them as one-hot, which they are.
    chi2, dof = transition_chi_square(run_speculative_step(greedy_sample))
    assert chi2 < chi_square_bound(dof), (chi2, dof)


@pytest.mark.parametrize("bias", ["temperature 1", "no Markov correction"])
def test_a_biased_sampler_fails_the_same_bound(bias):
    """Sampled drafts whose reported distribution is not the one they were drawn from (the
    temperature left out, or the Markov bias left out of the probabilities): the rejection
    sampler's output is then not the target's, and the bound catches it."""
    heads = PlainHeads()
    sample = position_sampler(True, sampling_metadata(torch.full((NUM_ROWS,), TEMPERATURE)))

    def biased(logits: torch.Tensor):
        tokens, _ = sample(logits.clone())
        if bias == "temperature 1":
            return tokens, logits.softmax(-1)
        # The anchor's bias removed: what a sampler reading the backbone logits would report.
        uncorrected = logits - heads.bias(heads.embed(torch.zeros_like(tokens)))
        return tokens, (uncorrected / TEMPERATURE).softmax(-1)

    chi2, dof = transition_chi_square(run_speculative_step(biased))
    assert chi2 > 10 * chi_square_bound(dof), (chi2, dof)


def test_sampled_drafts_without_probabilities_are_lossless_but_accepted_less():
    """vLLM treats missing draft probabilities as one-hot, which is exact for any drawn token
    (accept with p(d)); passing the draft's distribution accepts with min(1, p(d) / q(d)),
    never less. That is why the proposer hands its probabilities to rejection sampling."""
    sample = position_sampler(True, sampling_metadata(torch.full((NUM_ROWS,), TEMPERATURE)))
    with_probs = run_speculative_step(sample)

    def without_probs(logits: torch.Tensor):
        return sample(logits)[0], None

    one_hot = run_speculative_step(without_probs)
    chi2, dof = transition_chi_square(one_hot)
    assert chi2 < chi_square_bound(dof), (chi2, dof)
    accepted = [float((out >= 0).sum(dim=1).double().mean()) - 1 for out in (with_probs, one_hot)]
    assert accepted[0] > accepted[1] + 0.05, accepted
