# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Real sizes on the paged draft context: a 131072-token x 256-sequence engine on a 2 GiB
CPU KV budget decodes as fast as a 2048 x 8 one.

    VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/python -m benchmarks.scale [--rounds 3]

Target and DeepSpec-layout draft are tiny but have Qwen3-8B's KV width per layer (8 KV
heads of 128, bf16), so the draft's context K/V costs what it costs on the real model. Both
engines serve the same 8 short prompts, alternating round by round; the report gives the
median tokens/s of each and their ratio, which should stay near 1 (>= 0.8): the draft step
reads each request's own blocks, never max_model_len x max_num_seqs of anything. The
proposer logs the draft's share of the KV budget when the engine starts (look for
"DSpark draft context K/V").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from dspark_fixtures.checkpoints import qwen3
from dspark_fixtures.engine import TinyEngine, dspark_config

SHAPES = {"large": (131072, 256), "small": (2048, 8)}  # max_model_len, max_num_seqs
CONCURRENCY = 8
PROMPT_LEN = 64


def build(root: Path) -> tuple[Path, Path]:
    geometry = qwen3.WIDE_KV
    target = qwen3.build_qwen3_target(root / "target", geometry=geometry)
    spec = qwen3.DSparkDraftSpec(geometry=geometry)
    return target, qwen3.save_dspark_draft(root / "draft", spec, target=target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    prompts = [[5 + (31 * i + 7 * j) % 990 for j in range(PROMPT_LEN)] for i in range(CONCURRENCY)]
    speeds: dict[str, list[float]] = {name: [] for name in SHAPES}
    outputs: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="dspark-scale-") as workdir:
        target, draft = build(Path(workdir))
        for round_index in range(args.rounds):
            for name, (max_model_len, max_num_seqs) in SHAPES.items():
                print(f"round {round_index + 1}/{args.rounds}: {name} engine", flush=True)
                with TinyEngine(
                    target,
                    dspark_config(draft),
                    dtype="bfloat16",
                    max_model_len=max_model_len,
                    max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=2048,
                ) as engine:
                    engine.generate(prompts, 8)  # warm-up
                    run = engine.generate(prompts, args.max_tokens)
                speeds[name].append(run.tokens_per_s)
                outputs[name] = run.token_ids
    print(f"\nKV budget VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB")
    for name, (max_model_len, max_num_seqs) in SHAPES.items():
        print(
            f"{name:<6} max_model_len {max_model_len:>6} x max_num_seqs {max_num_seqs:>3}: "
            f"{statistics.median(speeds[name]):7.1f} tok/s (median of {args.rounds}; "
            f"samples {' '.join(f'{s:.1f}' for s in speeds[name])})"
        )
    ratio = statistics.median(speeds["large"]) / statistics.median(speeds["small"])
    print(f"decode speed large / small: {ratio:.2f}x (target >= 0.80)")
    print(f"greedy outputs equal across the two engines: {outputs['large'] == outputs['small']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
