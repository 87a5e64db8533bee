"""DeepSeek-V4 DSpark draft on CPU: every component and the whole draft against float64 references
written from the formulas (dsv4_reference.py), tensor-parallel shard sums, and the draft driven
through the drafter over many steps against a naive full recompute."""

import dataclasses

import pytest
import torch
from dsv4_reference import (
    TINY_CONFIG,
    Float64Reference,
    TinyTarget,
    build_draft,
    synthetic_checkpoint,
)

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.v1.spec_decode.dspark.deepseek_v4 import TensorParallelShard
from vllm.v1.spec_decode.dspark.deepseek_v4.layers import DSparkMoE
from vllm.v1.spec_decode.dspark.markov import markov_chain

H, D, W = TINY_CONFIG["hidden_size"], TINY_CONFIG["head_dim"], TINY_CONFIG["sliding_window"]
HC = TINY_CONFIG["hc_mult"]
STAGES = len(TINY_CONFIG["dspark_target_layer_ids"])
TOL = {"atol": 2e-5, "rtol": 2e-5}


@pytest.fixture(scope="module")
def checkpoint():
    return synthetic_checkpoint()


@pytest.fixture(scope="module")
def draft(checkpoint):
    return build_draft(checkpoint)


@pytest.fixture(scope="module")
def ref(checkpoint):
    return Float64Reference(checkpoint)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), **TOL)


def test_mhc_pre_and_post_match_float64(draft, ref):
    hc = draft.backbone.stages[1].hc_ffn
    streams = torch.randn(5, HC, H, generator=torch.Generator().manual_seed(1))
    layer_input, post, comb = hc.pre(streams)
    y = torch.randn(5, H)
    mixed = hc.post(y, streams, post, comb)
    for t in range(5):
        ref_input, ref_post, ref_comb = ref.mhc_pre(
            streams[t].double(), *(ref.p(1, f"hc_ffn_{n}") for n in ("fn", "base", "scale"))
        )
        close(layer_input[t], ref_input)
        close(post[t, :, 0], ref_post)
        close(comb[t], ref_comb)
        close(mixed[t], ref.mhc_post(y[t].double(), streams[t].double(), ref_post, ref_comb))
    # Sinkhorn makes the residual mixing doubly stochastic.
    torch.testing.assert_close(comb.sum(-2), torch.ones(5, HC), atol=1e-4, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(5, HC), atol=1e-3, rtol=0)


def test_hc_head_matches_float64(draft, ref):
    streams = torch.randn(6, HC, H, generator=torch.Generator().manual_seed(2))
    out = draft.backbone.stages[-1].hc_head(streams)
    for t in range(6):
        close(out[t], ref.hc_head(streams[t].double()))


def test_rope_matches_formula_and_inverse_rope_is_identity(draft, ref):
    attn = draft.backbone.stages[0].attn
    x = torch.randn(7, 4, D, generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([0, 1, 5, 8, 63, 200, 511])
    rotated = attn.rope(x, positions)
    for t, pos in enumerate(positions.tolist()):
        for h in range(4):
            close(rotated[t, h], ref.rope(x[t, h].double(), pos))
    rope_dims = TINY_CONFIG["qk_rope_head_dim"]
    assert torch.equal(rotated[..., :-rope_dims], x[..., :-rope_dims])
    assert not torch.allclose(rotated[1:], x[1:])
    close(attn.rope(rotated, positions, inverse=True), x)


def test_attention_with_sink_and_window_mask_matches_float64(draft, ref):
    g = torch.Generator().manual_seed(4)
    attn = draft.backbone.stages[1].attn
    hidden = torch.randn(2, 3, H, generator=g)
    positions = torch.tensor([[9, 10, 11], [30, 31, 32]])
    context = torch.randn(2, W, D, generator=g)
    mask = torch.tensor([[True] * 6 + [False] * 2, [True, False] * 4])
    out = attn(hidden, positions, context, mask)
    for b in range(2):
        visible = [context[b, t].double() for t in range(W) if mask[b, t]]
        close(out[b], ref.attention(1, hidden[b].double(), positions[b].tolist(), visible))
    # Masked-out ring entries have no influence at all.
    poisoned = torch.where(mask[..., None], context, torch.full_like(context, 1e4))
    torch.testing.assert_close(attn(hidden, positions, poisoned, mask), out)


def test_grouped_output_projection_matches_per_group_loop(draft, ref):
    attn = draft.backbone.stages[0].attn
    heads_out = torch.randn(1, 2, 4, D, generator=torch.Generator().manual_seed(5))
    out = attn.wo_b(attn.grouped_wo_a(heads_out))
    for j in range(2):
        close(out[0, j], ref.grouped_o(0, [heads_out[0, j, h].double() for h in range(4)]))


def test_moe_routing_matches_float64_and_vllm_cpu_kernel(draft, ref):
    moe = draft.backbone.stages[0].ffn
    x = torch.randn(32, H, generator=torch.Generator().manual_seed(6))
    weights, ids = moe.route(x)
    for t in range(32):
        ref_ids, ref_weights = ref.route(0, x[t].double())
        assert ids[t].tolist() == ref_ids
        close(weights[t], torch.tensor(ref_weights))
    # The correction bias changes which experts are picked for some tokens (it is live).
    unbiased = torch.topk(moe.gate(x), 2, dim=-1).indices
    assert (unbiased.sort().values != ids.sort().values).any()


@pytest.mark.skipif(
    not hasattr(torch.ops._C, "biased_topk_cpu"), reason="no vLLM CPU routing kernel in this build"
)
def test_routing_matches_vllm_cpu_kernel_at_the_real_expert_count(draft):
    """vLLM-CPU's DeepSeek-V4 router kernel only takes real expert counts: 256 experts, top-6."""
    config = dataclasses.replace(draft.backbone.config, n_routed_experts=256, num_experts_per_tok=6)
    with set_current_vllm_config(VllmConfig()):
        moe = DSparkMoE(config, TensorParallelShard(), torch.float32)
    g = torch.Generator().manual_seed(13)
    moe.gate.weight.data = torch.randn(256, H, generator=g) / H**0.5
    moe.gate.e_score_correction_bias.data = torch.randn(256, generator=g) * 0.1
    x = torch.randn(64, H, generator=g)
    weights, ids = moe.route(x)
    kernel_weights, kernel_ids = torch.ops._C.biased_topk_cpu(
        x, moe.gate(x), moe.gate.e_score_correction_bias, 6, True, "sqrtsoftplus", 0, 1.5, True
    )
    mine, theirs = ids.sort(-1), kernel_ids.long().sort(-1)
    assert torch.equal(mine.values, theirs.values)
    torch.testing.assert_close(
        kernel_weights.gather(-1, theirs.indices), weights.gather(-1, mine.indices)
    )


def test_moe_with_clamped_swiglu_and_shared_expert_matches_float64(draft, ref):
    moe = draft.backbone.stages[1].ffn
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(7))
    out = moe(x)
    for t in range(9):
        close(out[t], ref.moe(1, x[t].double()))
    # The clamp is exercised: some gate and up pre-activations exceed swiglu_limit.
    gate_up = moe.shared_experts.gate_up_proj(x)
    assert (gate_up.abs() > TINY_CONFIG["swiglu_limit"]).any()


def test_context_entries_match_float64(draft, ref):
    features = torch.randn(5, STAGES * H, generator=torch.Generator().manual_seed(8))
    positions = torch.tensor([0, 3, 4, 17, 100])
    entries = draft.backbone.context_entries(features, positions)
    assert entries.shape == (5, *draft.backbone.ring_entry_shape) == (5, STAGES, D)
    for t, pos in enumerate(positions.tolist()):
        close(entries[t], ref.context_entries(features[t], pos))


def test_block_hidden_matches_float64(draft, ref):
    g = torch.Generator().manual_seed(9)
    backbone = draft.backbone
    embeds = torch.randn(2, 4, H, generator=g)
    positions = torch.tensor([[12, 13, 14, 15], [3, 4, 5, 6]])
    context = torch.randn(2, W, STAGES, D, generator=g)
    context_positions = torch.tensor([[8, 9, 10, 11, 4, 5, 6, 7], [0, 1, 2, -1, -1, -1, -1, -1]])
    mask = context_positions >= 0
    logit_hidden, confidence_hidden = backbone.block_hidden(
        embeds, positions, context, context_positions, mask
    )
    for b in range(2):
        ref_logit, ref_dense = ref.block_hidden(
            embeds[b], positions[b].tolist(), context[b][mask[b]]
        )
        close(logit_hidden[b], ref_logit)
        close(confidence_hidden[b], ref_dense)


def test_bf16_draft_runs_and_stays_close_to_float64(checkpoint, ref):
    """The serving dtype: bf16 weights and activations, fp32 mHC, router and softmax."""
    backbone = build_draft(checkpoint, dtype=torch.bfloat16).backbone
    g = torch.Generator().manual_seed(14)
    features = torch.randn(W, STAGES * H, generator=g)
    entries = backbone.context_entries(features.bfloat16(), torch.arange(W))
    assert entries.dtype == torch.bfloat16
    embeds = torch.randn(1, 4, H, generator=g)
    logit_hidden, _ = backbone.block_hidden(
        embeds.bfloat16(),
        torch.arange(W, W + 4)[None],
        entries[None],
        torch.arange(W)[None],
        torch.ones(1, W, dtype=torch.bool),
    )
    reference = torch.stack([ref.context_entries(features[p], p) for p in range(W)])
    ref_logit, _ = ref.block_hidden(embeds[0], list(range(W, W + 4)), reference)
    error = (logit_hidden[0].double() - ref_logit).norm() / ref_logit.norm()
    assert logit_hidden.dtype == torch.bfloat16 and error < 0.05


def test_markov_chain_and_confidence_match_float64(draft, ref, checkpoint):
    target = TinyTarget(checkpoint)
    draft.share_target(target)
    g = torch.Generator().manual_seed(10)
    dense = torch.randn(3, 4, H, generator=g)
    anchors = torch.tensor([5, 77, 255])
    base_logits = target.compute_logits(dense)
    drafts, markov_embeds = markov_chain(
        base_logits, anchors, draft.markov_embed, draft.markov_bias
    )
    confidence = draft.confidence(dense, markov_embeds)
    for b in range(3):
        ref_drafts, ref_confidence, gap = ref.markov_and_confidence(
            base_logits[b], dense[b].double(), int(anchors[b])
        )
        assert gap > 1e-3, "near-tie: exact token comparison would be meaningless"
        assert drafts[b].tolist() == ref_drafts
        close(confidence[b], torch.tensor(ref_confidence))


@pytest.fixture(scope="module")
def rank_drafts(checkpoint):
    return [build_draft(checkpoint, shard=TensorParallelShard(rank, 2)) for rank in range(2)]


def test_tp2_attention_shards_sum_to_the_full_output(draft, rank_drafts, checkpoint):
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(2, 3, H, generator=g)
    positions = torch.tensor([[4, 5, 6], [20, 21, 22]])
    context = torch.randn(2, W, D, generator=g)
    mask = torch.rand(2, W, generator=g) > 0.3
    full = draft.backbone.stages[0].attn(hidden, positions, context, mask)
    partials = [d.backbone.stages[0].attn(hidden, positions, context, mask) for d in rank_drafts]
    assert not torch.allclose(partials[0], full)
    torch.testing.assert_close(partials[0] + partials[1], full, atol=1e-5, rtol=1e-5)
    sink = checkpoint["mtp.0.attn.attn_sink"]
    for rank, d in enumerate(rank_drafts):
        assert torch.equal(d.backbone.stages[0].attn.attn_sink, sink[2 * rank : 2 * rank + 2])


def test_tp2_moe_shards_sum_to_the_full_output(draft, rank_drafts):
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(12))
    full = draft.backbone.stages[1].ffn(x)
    partials = [d.backbone.stages[1].ffn(x) for d in rank_drafts]
    assert rank_drafts[1].backbone.stages[1].ffn.experts.w13_weight.shape[0] == 2
    torch.testing.assert_close(partials[0] + partials[1], full, atol=1e-5, rtol=1e-5)
