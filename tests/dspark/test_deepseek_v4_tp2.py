"""Two real tensor-parallel ranks (two processes, vLLM's CPU communicator over gloo): each builds
its shard from vLLM's TP group and all-reduces with vLLM, and the block matches the TP=1 draft.
About a minute: each process imports vLLM."""

import os

import torch
import torch.multiprocessing as mp
from dsv4_reference import TINY_CONFIG, build_draft, synthetic_checkpoint

from vllm.config import VllmConfig, set_current_vllm_config

W, H = TINY_CONFIG["sliding_window"], TINY_CONFIG["hidden_size"]


def block_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(W, 2 * H, generator=g), torch.randn(2, 4, H, generator=g)


def run_block(backbone) -> torch.Tensor:
    features, embeds = block_inputs()
    entries = backbone.context_entries(features, torch.arange(W))
    logit_hidden, _ = backbone.block_hidden(
        embeds,
        torch.arange(W, W + 4).repeat(2, 1),
        torch.stack([entries, entries.flip(0)]),
        torch.arange(W).repeat(2, 1),
        torch.ones(2, W, dtype=torch.bool),
    )
    return logit_hidden


def rank_worker(rank: int, init_file: str, out_dir: str) -> None:
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.v1.spec_decode.dspark.deepseek_v4 import (
        build_deepseek_v4_draft_model,
        load_deepseek_v4_draft,
    )

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
    assert model.backbone.shard.size == 2 and model.backbone.shard.rank == rank
    torch.save(run_block(model.backbone), os.path.join(out_dir, f"rank{rank}.pt"))


def test_two_process_tp2_draft_matches_tp1(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_DIST_IDENT", f"dsv4-tp2-{os.getpid()}")
    mp.spawn(rank_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    unsharded = run_block(build_draft(synthetic_checkpoint()).backbone)
    for rank in range(2):
        sharded = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(sharded, unsharded, atol=1e-5, rtol=1e-5)
