"""The DeepSeek-V4 draft driven through the drafter (ring, slots, Markov chain, confidence) over
many steps with window wrap-around, rejected suffixes, a request joining mid-run and reordered
batches, against a naive float64 recompute of every block from each request's full history."""

import torch
from dsv4_reference import (
    TINY_CONFIG,
    Float64Reference,
    TinyTarget,
    build_draft,
    synthetic_checkpoint,
)

from vllm.v1.spec_decode.dspark.drafter import BLOCK_START_OFFSET, BlockDrafter
from vllm.v1.spec_decode.dspark.ring import ContextRing

K = TINY_CONFIG["dspark_block_size"]
W = TINY_CONFIG["sliding_window"]
NOISE = TINY_CONFIG["dspark_noise_token_id"]
FEATURES = len(TINY_CONFIG["dspark_target_layer_ids"]) * TINY_CONFIG["hidden_size"]


class RequestHistory:
    """What the target really produced for one request: a feature row per verified position."""

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.features: dict[int, torch.Tensor] = {}
        self.next_position = 0  # position of the token the target sampled last (the anchor token)
        self.anchor_token = 0


def naive_draft(ref: Float64Reference, target: TinyTarget, request: RequestHistory):
    """Recompute the request's block from scratch: context = its last W verified positions."""
    anchor = request.next_position - 1
    window = [p for p in range(anchor - W + 1, anchor + 1) if p in request.features]
    context = torch.stack([ref.context_entries(request.features[p], p) for p in window])
    start = anchor + BLOCK_START_OFFSET
    block_tokens = torch.tensor([request.anchor_token] + [NOISE] * (K - 1))
    logit_hidden, dense = ref.block_hidden(
        target.embed[block_tokens].double(), list(range(start, start + K)), context
    )
    base_logits = logit_hidden @ target.head.double().t()
    return ref.markov_and_confidence(base_logits, dense, request.anchor_token)


def test_draft_matches_full_recompute_over_many_steps():
    checkpoint = synthetic_checkpoint(seed=3)
    draft = build_draft(checkpoint)
    target = TinyTarget(checkpoint)
    draft.share_target(target)
    ref = Float64Reference(checkpoint)
    ring = ContextRing(
        num_slots=5, window=W, entry_shape=(2, 32), dtype=torch.float32, device="cpu"
    )
    drafter = BlockDrafter(
        draft.backbone, draft, ring, noise_token_id=NOISE, max_position=511, max_num_drafts=K
    )
    g = torch.Generator().manual_seed(0)
    requests = {name: RequestHistory(slot) for name, slot in (("a", 2), ("b", 0), ("c", 1))}
    prefill = {"a": 5, "b": 11, "c": 3}  # b's prompt is longer than the window
    wraps = rejections = 0
    compared = 0

    for step in range(12):
        if step == 4:
            requests["d"] = RequestHistory(3)  # joins mid-run with a chunked prefill
            prefill["d"] = 13
        order = list(requests)
        if step % 3 == 1:
            order.reverse()  # the runner may reorder batch rows between steps
        rows, positions, starts, rejected = [], [], [0], []
        for name in order:
            request = requests[name]
            if name in prefill:  # prefill chunk: every row is verified
                length, num_rejected = prefill.pop(name), 0
            else:  # verify [anchor token, K drafts]; a random suffix is rejected
                length = K + 1
                num_rejected = int(torch.randint(0, K + 1, (1,), generator=g))
                rejections += num_rejected > 0
            features = torch.randn(length, FEATURES, generator=g)
            base = request.next_position
            for i in range(length - num_rejected):
                request.features[base + i] = features[i]
            request.next_position = base + length - num_rejected
            request.anchor_token = int(torch.randint(0, NOISE, (1,), generator=g))
            wraps += request.next_position > W
            rows.append(features)
            positions.append(torch.arange(base, base + length))
            starts.append(starts[-1] + length)
            rejected.append(num_rejected)

        slots = torch.tensor([requests[name].slot for name in order])
        output = drafter.step(
            slots,
            torch.cat(rows),
            torch.cat(positions),
            torch.tensor(starts),
            torch.tensor(rejected),
            torch.tensor([requests[name].anchor_token for name in order]),
            num_drafts=K,
            with_confidence=True,
        )
        for b, name in enumerate(order):
            tokens, confidence, gap = naive_draft(ref, target, requests[name])
            assert gap > 1e-3, "near-tie: exact token comparison would be meaningless"
            assert output.token_ids[b].tolist() == tokens, (step, name)
            torch.testing.assert_close(
                output.confidence[b].double(),
                torch.tensor(confidence, dtype=torch.float64),
                atol=2e-5,
                rtol=2e-5,
            )
            compared += 1

    assert wraps > 10 and rejections > 10 and compared == 12 * 3 + 8
