# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The plain-torch block draft keeps vLLM's conventions: taps, masks, positions."""

from __future__ import annotations

import pytest
import torch

from benchmarks.draft_reference import BlockLayout, TargetFeatureTap
from benchmarks.train_tiny_drafter import Corpus, make_draft, simulate_acceptance
from dspark_fixtures.checkpoints.qwen3 import (
    HIDDEN_SIZE,
    DSparkDraftSpec,
    build_qwen3_target,
    load_target,
    random_dspark_weights,
)

SEQ_LEN = 24


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(build_qwen3_target(tmp_path_factory.mktemp("ref") / "target"))


@pytest.fixture(scope="module")
def sequences() -> torch.Tensor:
    return torch.randint(5, 1000, (3, SEQ_LEN), generator=torch.Generator().manual_seed(0))


def test_tap_is_the_residual_stream_before_the_final_norm(target, sequences):
    features = TargetFeatureTap(target, [0, 1]).features(sequences)
    out = target(input_ids=sequences, output_hidden_states=True)
    after_layer0, after_layer1 = features.split(HIDDEN_SIZE, dim=-1)
    # HF: hidden_states[1] is after layer 0; its last entry is post-norm.
    torch.testing.assert_close(after_layer0, out.hidden_states[1])
    torch.testing.assert_close(target.model.norm(after_layer1), out.hidden_states[-1])
    assert not torch.allclose(after_layer1, out.hidden_states[-1])


@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_block_sees_context_up_to_the_anchor_only(target, sequences, sample_from_anchor):
    draft = make_draft(target, random_dspark_weights(DSparkDraftSpec()))
    layout = BlockLayout(4, sample_from_anchor)
    features = TargetFeatureTap(target, [0, 1]).features(sequences)
    anchors = torch.tensor([[10]] * len(sequences))
    logits = draft.base_logits(features, sequences, anchors, layout)
    assert logits.shape == (3, 1, 4, 1000)

    later = features.clone()
    later[:, 11:] += 1.0  # positions past the anchor must not matter
    torch.testing.assert_close(draft.base_logits(later, sequences, anchors, layout), logits)
    at_anchor = features.clone()
    at_anchor[:, 10] += 1.0
    assert not torch.allclose(draft.base_logits(at_anchor, sequences, anchors, layout), logits)


def test_block_attention_is_bidirectional(target, sequences):
    """Slot 0 sees the later noise slots: its logits change with the block length."""
    draft = make_draft(target, random_dspark_weights(DSparkDraftSpec()))
    features = TargetFeatureTap(target, [0, 1]).features(sequences)
    anchors = torch.tensor([[10]] * len(sequences))
    two = draft.base_logits(features, sequences, anchors, BlockLayout(2, True))
    four = draft.base_logits(features, sequences, anchors, BlockLayout(4, True))
    assert not torch.allclose(two[..., 0, :], four[..., 0, :])


def test_acceptance_replay_counts_prefixes_and_moves_the_anchor(target):
    """A draft that always proposes the truth gets tau = k + 1; one that never does
    gets 1; the replay visits the anchors a speculative decoder would."""

    class Scripted:
        def __init__(self, correct: bool):
            self.correct = correct

        def draft(self, features, token_ids, anchors, layout):
            positions = anchors[..., None] + 2 + torch.arange(layout.num_draft_tokens)
            truth = torch.gather(token_ids, 1, positions.flatten(1)).view_as(positions)
            return truth if self.correct else truth + 1

    tokens = torch.arange(40).expand(2, -1)
    corpus = Corpus(token_ids=tokens, features=torch.zeros(2, 40, 1), prompt_len=8)
    layout = BlockLayout(4, True)
    perfect = simulate_acceptance(Scripted(True), corpus, layout)
    assert perfect.tau == 5.0 and perfect.acceptance_per_pos == [1.0] * 4
    # Anchors 7, 12, ..., 32 (<= 40 - 2 - 4) per sequence: 6 blocks each.
    assert perfect.blocks == 12
    useless = simulate_acceptance(Scripted(False), corpus, layout)
    assert useless.tau == 1.0 and useless.blocks == 2 * (34 - 7 + 1)
