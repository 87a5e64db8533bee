# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Confidence-scheduled verification side by side on the CPU engine.

    .venv/bin/python -m benchmarks.confidence_scheduling [--repeats 3] [--concurrency 1 4 8]

Runs the same prompts with DSpark and the confidence scheduler off and
`threshold` at two values of tau, alternating the schedulers within each repeat
(machines here are noisy), and prints per scheduler and concurrency: median
generated tokens/s, tau (tokens per verify step), drafts verified per step, and
the ratio of tokens/s to `off`. The draft is the tiny bigram pair with the
random confidence head of the tiny models, whose confidences vary by position
around 0.5: it shows what shortening verification does to speed and acceptance
on this machine, not what a trained confidence head would gain on a GPU. On a
CPU with tiny models the target's step cost barely grows with the verified
rows, so shorter verification mainly loses accepted tokens here.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dspark_fixtures.checkpoints import qwen3
from dspark_fixtures.engine import TinyEngine, dspark_config

SCHEDULERS = {
    "off": {},
    "threshold-0.3": {
        "dspark_confidence_scheduler": "threshold",
        "dspark_confidence_threshold": 0.3,
    },
    "threshold-0.5": {
        "dspark_confidence_scheduler": "threshold",
        "dspark_confidence_threshold": 0.5,
    },
}
K = 4


def build_models(root: Path) -> tuple[Path, Path]:
    target = qwen3.build_qwen3_target(root / "target", kind="bigram")
    spec = qwen3.DSparkDraftSpec(
        markov_rank=qwen3.HIDDEN_SIZE, confidence_head=True, confidence_with_markov=True
    )
    weights = qwen3.bigram_dspark_weights(spec, target)
    return target, qwen3.save_dspark_draft(root / "draft", spec, weights, target)


def measure(target: Path, draft: Path, options: dict, concurrency: int, max_tokens: int) -> dict:
    prompts = [f"w{17 * i % 990} w{31 * i % 990} w{7 * i % 990}" for i in range(concurrency * 2)]
    engine_args = dict(max_model_len=512, max_num_seqs=concurrency, block_size=None)
    with TinyEngine(target, dspark_config(draft, K, **options), **engine_args) as engine:
        engine.generate(prompts[:1], max_tokens)  # warm-up
        run = engine.generate(prompts, max_tokens)
    verified = run.metrics["vllm:spec_decode_num_draft_tokens"]
    return {
        "tokens_per_s": run.tokens_per_s,
        "tau": run.tau or 1.0,
        "verified_per_step": verified / run.drafts if run.drafts else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        target, draft = build_models(Path(workdir))
        results: dict[tuple[str, int], list[dict]] = {}
        for concurrency in args.concurrency:
            for repeat in range(args.repeats):
                for name, options in SCHEDULERS.items():  # alternate: A B C A B C ...
                    print(f"c={concurrency} repeat {repeat + 1}: {name}", flush=True)
                    run = measure(target, draft, options, concurrency, args.max_tokens)
                    results.setdefault((name, concurrency), []).append(run)

    print(f"\n{'scheduler':<15}{'conc':>5}{'tok/s':>9}{'tau':>7}{'verified/step':>15}{'vs off':>8}")
    for concurrency in args.concurrency:
        base = statistics.median(r["tokens_per_s"] for r in results[("off", concurrency)])
        for name in SCHEDULERS:
            runs = results[(name, concurrency)]
            rate = statistics.median(r["tokens_per_s"] for r in runs)
            tau = statistics.median(r["tau"] for r in runs)
            verified = statistics.median(r["verified_per_step"] for r in runs)
            print(
                f"{name:<15}{concurrency:>5}{rate:>9.0f}{tau:>7.2f}{verified:>15.2f}"
                f"{rate / base:>8.2f}"
            )


if __name__ == "__main__":
    main()
