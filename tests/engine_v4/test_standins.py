# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Each Triton stand-in against a plain per-token loop written from its kernel's source."""

import random

import torch

from dspark_fixtures import standins


def _batch(seed: int, num_reqs: int, block_size: int):
    rng = random.Random(seed)
    query_lens = [rng.randrange(1, 9) for _ in range(num_reqs)]
    prefix_lens = [rng.randrange(0, 40) for _ in range(num_reqs)]
    query_start_loc = torch.tensor(
        [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32
    )
    seq_lens = torch.tensor(
        [p + q for p, q in zip(prefix_lens, query_lens, strict=True)], dtype=torch.int32
    )
    block_table = torch.randint(0, 100, (num_reqs, 64 // block_size + 2), dtype=torch.int32)
    replay_start = torch.tensor([rng.randrange(0, 6) for _ in range(num_reqs)], dtype=torch.int32)
    return query_start_loc, seq_lens, block_table, replay_start


def test_token_request_mapping_matches_the_kernel_loop():
    for seed in range(5):
        query_start_loc, *_ = _batch(seed, 6, 4)
        num_tokens = int(query_start_loc[-1]) + 3
        num_mapped = num_tokens - 3
        out = torch.full((num_tokens + 2,), -7, dtype=torch.int32)
        standins.token_request_mapping(query_start_loc, out, 6, num_mapped, num_tokens)
        for token in range(num_tokens):
            want = 0
            if token < num_mapped:
                want = next(r for r in range(6) if query_start_loc[r + 1] > token)
            assert int(out[token]) == want
        assert out[num_tokens:].tolist() == [-7, -7]


def test_swa_indices_and_lens_match_the_kernel_loop():
    window, width, block_size = 8, 10, 4
    for seed in range(5):
        query_start_loc, seq_lens, block_table, replay_start = _batch(seed, 5, block_size)
        num_tokens = int(query_start_loc[-1])
        token_req = torch.searchsorted(query_start_loc[1:], torch.arange(num_tokens), right=True)
        valid = torch.rand(num_tokens, generator=torch.Generator().manual_seed(seed)) > 0.2
        indices = torch.full((num_tokens, 1, width), 99, dtype=torch.int32)
        lens = torch.full((num_tokens,), 99, dtype=torch.int32)
        standins.SWAIndicesAndLens()(
            indices,
            lens,
            window,
            width,
            lens,
            lens,
            query_start_loc,
            seq_lens,
            token_req.int(),
            valid,
            block_table,
            block_size,
            replay_start,
            num_tokens=num_tokens,
            token_offset=0,
        )
        for t in range(num_tokens):
            if not valid[t]:
                assert lens[t] == 0 and indices[t, 0].tolist() == [-1] * width
                continue
            r = int(token_req[t])
            q0, q1 = int(query_start_loc[r]), int(query_start_loc[r + 1])
            pos = int(seq_lens[r]) - (q1 - q0) + t - q0
            start = max(max(pos - (window - 1), 0), int(replay_start[r]))
            length = pos + 1 - start
            assert int(lens[t]) == length
            want = [
                int(block_table[r, (start + i) // block_size]) * block_size
                + (start + i) % block_size
                if i < length
                else -1
                for i in range(width)
            ]
            assert indices[t, 0].tolist() == want


def test_prefill_gather_lens_match_the_kernel_loop():
    for seed in range(5):
        query_start_loc, seq_lens, _, replay_start = _batch(seed, 6, 4)
        out = torch.zeros(4, dtype=torch.int32)
        standins.PrefillMetadata()(out, seq_lens, query_start_loc, replay_start, 4, 2, 8)
        for i in range(4):
            r = 2 + i
            query_len = int(query_start_loc[r + 1] - query_start_loc[r])
            visible = max(int(seq_lens[r]) - query_len - int(replay_start[r]), 0)
            assert int(out[i]) == query_len + min(visible, 7)
