# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Markov top-k (``dspark_draft_topk``) against the full chain, side by side on this CPU.

    .venv/bin/python -m benchmarks.markov_topk [--vocab 32768] [--rank 256] [--topk 64]

Runs ``dspark/markov.py::markov_chain`` with vLLM's ``DSparkMarkovHead`` (the proposer's head)
over the same base logits, full and top-k, alternating within each repeat, and prints the median
time per chain of each, their ratio, and how many drafts are identical. The base logits are drawn
so that, like a trained draft's, each position has a clear leader among a few candidates and the
Markov bias is a correction of a few logits, not a replacement: top-k is exact exactly when each
position's corrected argmax is among its top-k base logits, which the script also counts.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.models.qwen3_dspark import DSparkMarkovHead
from vllm.v1.spec_decode.dspark.markov import markov_chain


def build_head(vocab: int, rank: int, seed: int) -> tuple[DSparkMarkovHead, LogitsProcessor]:
    g = torch.Generator().manual_seed(seed)
    with set_current_vllm_config(VllmConfig()):
        head = DSparkMarkovHead(vocab, vocab, rank, prefix="markov_head")
        logits = LogitsProcessor(vocab)
    head.markov_w1.weight.data = torch.randn(vocab, rank, generator=g) / rank**0.5
    head.markov_w2.weight.data = torch.randn(tuple(head.markov_w2.weight.shape), generator=g)
    head.markov_w2.quant_method.process_weights_after_loading(head.markov_w2)
    return head, logits


def base_logits(batch: int, block: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, block, vocab, generator=g)
    # A few strong candidates per position, as a trained draft's head produces.
    leaders = torch.randint(0, vocab, (batch, block, 8), generator=g)
    logits.scatter_add_(-1, leaders, 8.0 + 2.0 * torch.rand(batch, block, 8, generator=g))
    return logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--block", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    head, processor = build_head(args.vocab, args.rank, seed=0)

    def bias(embed: torch.Tensor) -> torch.Tensor:
        return head.bias(embed, processor)

    print(
        f"vocab {args.vocab}, rank {args.rank}, block {args.block}, topk {args.topk}, "
        f"{torch.get_num_threads()} threads; median of {args.repeats} alternating runs"
    )
    print("batch  full ms  top-k ms  speedup  identical drafts  argmax in top-k")
    for batch in args.batch:
        base = base_logits(batch, args.block, args.vocab, seed=batch)
        anchors = torch.randint(0, args.vocab, (batch,), generator=torch.Generator().manual_seed(1))
        times: dict[str, list[float]] = {"full": [], "topk": []}
        drafts = {}
        for _ in range(args.repeats):
            for name in times:
                logits = base.clone()
                start = time.perf_counter()
                if name == "full":
                    out = markov_chain(logits, anchors, head.embed, bias)
                else:
                    out = markov_chain(
                        logits,
                        anchors,
                        head.embed,
                        bias,
                        topk=args.topk,
                        markov_bias_gathered=head.apply_bias_gathered,
                    )
                times[name].append(time.perf_counter() - start)
                drafts[name] = out.token_ids
        full_ms = 1e3 * statistics.median(times["full"])
        topk_ms = 1e3 * statistics.median(times["topk"])
        identical = int((drafts["full"] == drafts["topk"]).sum())
        candidates = base.topk(args.topk, dim=-1).indices
        covered = int((candidates == drafts["full"].unsqueeze(-1)).any(-1).sum())
        total = drafts["full"].numel()
        print(
            f"{batch:5d}  {full_ms:7.2f}  {topk_ms:8.2f}  {full_ms / topk_ms:6.2f}x  "
            f"{identical:7d} / {total:<7d}  {covered:7d} / {total}"
        )


if __name__ == "__main__":
    main()
