# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Greedy against probabilistic DSpark drafts at temperature 1, side by side on the CPU engine.

    .venv/bin/python -m benchmarks.draft_sampling [--repeats 3] [--concurrency 4]

For each tiny pair (the bigram pair, whose Markov head reproduces the target's next-token
function, and the random pair) it runs the same prompts with `draft_sample_method` greedy and
probabilistic, alternating within each repeat (machines here are noisy), all requests sampled
at temperature 1, and prints the median tokens/s, the acceptance rate at each draft position
(vLLM's accepted-per-position counter over its draft counter) and the probabilistic/greedy
tokens/s ratio. Output is lossless either way; only acceptance and speed differ.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dspark_fixtures.checkpoints import qwen3
from dspark_fixtures.engine import TinyEngine, dspark_config

K = 4
METHODS = ("greedy", "probabilistic")


def build_pairs(root: Path) -> dict[str, tuple[Path, Path]]:
    bigram_target = qwen3.build_qwen3_target(root / "bigram-target", kind="bigram")
    bigram_spec = qwen3.DSparkDraftSpec(markov_rank=qwen3.HIDDEN_SIZE)
    bigram_draft = qwen3.save_dspark_draft(
        root / "bigram-draft",
        bigram_spec,
        qwen3.bigram_dspark_weights(bigram_spec, bigram_target),
        bigram_target,
    )
    random_target = qwen3.build_qwen3_target(root / "random-target")
    random_draft = qwen3.save_dspark_draft(
        root / "random-draft", qwen3.DSparkDraftSpec(), target=random_target
    )
    return {"bigram": (bigram_target, bigram_draft), "random": (random_target, random_draft)}


def measure(target: Path, draft: Path, method: str, concurrency: int, max_tokens: int) -> dict:
    prompts = [f"w{17 * i % 990} w{31 * i % 990} w{7 * i % 990}" for i in range(concurrency * 2)]
    config = dspark_config(draft, K, draft_sample_method=method)
    engine_args = dict(max_model_len=512, max_num_seqs=concurrency, block_size=None)
    with TinyEngine(target, config, **engine_args) as engine:
        engine.generate(prompts[:1], max_tokens, temperature=1.0)  # warm-up
        run = engine.generate(prompts, max_tokens, temperature=1.0)
    return {
        "tokens_per_s": run.tokens_per_s,
        "acceptance": [a / run.drafts if run.drafts else 0.0 for a in run.accepted_per_position],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        pairs = build_pairs(Path(workdir))
        results: dict[tuple[str, str], list[dict]] = {}
        for pair, (target, draft) in pairs.items():
            for repeat in range(args.repeats):
                for method in METHODS:  # alternate: greedy, probabilistic, greedy, ...
                    print(f"{pair} repeat {repeat + 1}: {method}", flush=True)
                    run = measure(target, draft, method, args.concurrency, args.max_tokens)
                    results.setdefault((pair, method), []).append(run)

    print(f"\ntemperature 1, k={K}, concurrency {args.concurrency}, medians of {args.repeats} runs")
    header = "".join(f"{f'acc@{j}':>8}" for j in range(K))
    print(f"{'pair':<8}{'drafts':<15}{'tok/s':>8}{header}{'vs greedy':>11}")
    for pair in pairs:
        base = statistics.median(r["tokens_per_s"] for r in results[(pair, "greedy")])
        for method in METHODS:
            runs = results[(pair, method)]
            rate = statistics.median(r["tokens_per_s"] for r in runs)
            acceptance = [statistics.median(r["acceptance"][j] for r in runs) for j in range(K)]
            cells = "".join(f"{a:>8.2f}" for a in acceptance)
            print(f"{pair:<8}{method:<15}{rate:>8.0f}{cells}{rate / base:>11.2f}")


if __name__ == "__main__":
    main()
