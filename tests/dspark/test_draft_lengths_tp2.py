"""Confidence-scheduled lengths on two real tensor-parallel ranks (two processes, vLLM's CPU
communicator over gloo): each rank runs its shard of the DeepSeek-V4 draft block, the confidence
head on the all-reduced hidden states, and every scheduler; the lengths agree on both ranks.
About a minute: each process imports vLLM."""

import os

import torch
import torch.multiprocessing as mp
from dsv4_reference import TINY_CONFIG, synthetic_checkpoint

from vllm.config import VllmConfig, set_current_vllm_config

W, H = TINY_CONFIG["sliding_window"], TINY_CONFIG["hidden_size"]
NUM_REQUESTS, K = 24, 4
SCHEDULES = {
    "threshold": {"scheduler": "threshold", "threshold": 0.5},
    "survival_threshold": {"scheduler": "survival_threshold", "threshold": 0.3},
    "hardware": {"scheduler": "hardware", "step_rate_curve": "1:100,32:90,64:60,96:40"},
}


def rank_worker(rank: int, init_file: str, out_dir: str) -> None:
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.v1.spec_decode.dspark.deepseek_v4 import (
        build_deepseek_v4_draft_model,
        load_deepseek_v4_draft,
    )
    from vllm.v1.spec_decode.dspark.scheduling import ConfidenceScheduleConfig, schedule_lengths

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=2,
            rank=rank,
            local_rank=rank,
            distributed_init_method=f"file://{init_file}",
            backend="gloo",
        )
        initialize_model_parallel(2)
        model = build_deepseek_v4_draft_model(
            TINY_CONFIG, vocab_size=TINY_CONFIG["vocab_size"], dtype=torch.float32
        )
    load_deepseek_v4_draft(model, synthetic_checkpoint().items())
    # What vLLM's loader does after loading (the CPU linear layers set up their kernels here).
    for module in model.modules():
        quant_method = getattr(module, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(module)
    assert model.backbone.shard.size == 2 and model.backbone.shard.rank == rank

    g = torch.Generator().manual_seed(0)
    features = torch.randn(W, 2 * H, generator=g)
    entries = model.backbone.context_entries(features, torch.arange(W))
    context = torch.stack([entries.roll(i, dims=0) for i in range(NUM_REQUESTS)])
    _, confidence_hidden = model.backbone.block_hidden(
        torch.randn(NUM_REQUESTS, K, H, generator=g),
        torch.arange(W, W + K).repeat(NUM_REQUESTS, 1),
        context,
        torch.arange(W).repeat(NUM_REQUESTS, 1),
        torch.rand(NUM_REQUESTS, W, generator=g) > 0.2,
    )
    previous = torch.randint(0, TINY_CONFIG["vocab_size"], (NUM_REQUESTS, K), generator=g)
    confidence = model.confidence(confidence_hidden, model.markov_embed(previous))
    results = {"confidence": confidence}
    for name, fields in SCHEDULES.items():
        config = ConfidenceScheduleConfig.from_fields(**fields)
        results[name] = schedule_lengths(confidence, config, K)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def test_both_ranks_schedule_the_same_lengths(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_DIST_IDENT", f"lengths-tp2-{os.getpid()}")
    mp.spawn(rank_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for name in SCHEDULES:
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        # Not degenerate: the requests get different lengths.
        assert len(set(ranks[0][name].tolist())) > 1, (name, ranks[0][name].tolist())
