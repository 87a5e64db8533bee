# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""See DSpark work on a laptop: tiny local models, vLLM with and without DSpark.

    .venv/bin/python -m dspark_demo [--pair bigram|oracle|random] [--k 4]

Builds a tiny Qwen3 target and a DSpark draft (no hub), generates greedily with
plain vLLM and with DSpark on the V1 runner, and prints both outputs, whether
they are equal, the acceptance per draft position and the tokens per second of
each: the median of several timed runs with their spread (one sub-second run on
a shared CPU varies by 100x). Needs the vLLM that install.py patched.
"""

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dspark_demo.checkpoints import qwen3 as tiny_models
from dspark_demo.engine import EngineRun, TinyEngine, dspark_config

PAIRS = {
    "bigram": "a bigram target and a draft whose Markov head knows it, blurred: partial acceptance",
    "oracle": "a zero-lm_head target and a draft that always agrees with it: full acceptance",
    "random": "a random target and a random draft: almost nothing accepted, output still equal",
}
PROMPTS = [
    "w12 w7 w300 w41 w5",
    "w900 w901 w902 w903 w904 w905 w906 w907",
    "w1 w2 w3",
    "w500 w42 w42 w42 w7 w8 w9 w10 w11 w12 w13 w14",
]


def build_pair(pair: str, root: Path) -> tuple[Path, Path]:
    """A target and a draft written in DeepSpec's layout."""
    spec = tiny_models.DSparkDraftSpec()
    if pair == "bigram":
        target = tiny_models.build_qwen3_target(root / "target", kind="bigram")
        spec = tiny_models.DSparkDraftSpec(markov_rank=tiny_models.HIDDEN_SIZE)
        weights = tiny_models.bigram_dspark_weights(spec, target)
    elif pair == "oracle":
        target = tiny_models.build_qwen3_target(root / "target", kind="zero-lm-head")
        weights = tiny_models.oracle_dspark_weights(spec)
    else:
        target = tiny_models.build_qwen3_target(root / "target")
        weights = tiny_models.random_dspark_weights(spec)
    return target, tiny_models.save_dspark_draft(root / "draft", spec, weights, target)


@dataclass(frozen=True)
class Spread:
    """Median and range of repeated measurements."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> "Spread":
        if not values:
            raise ValueError("no measurements")
        return cls(statistics.median(values), min(values), max(values))

    def __str__(self) -> str:
        return f"{self.median:.0f} (range {self.low:.0f}-{self.high:.0f})"


def generate(
    target: Path, speculative_config: dict | None, max_tokens: int, repeats: int
) -> tuple[EngineRun, Spread]:
    """The first timed run, and tokens/s over `repeats` timed runs (greedy: each run must
    produce the same tokens)."""
    with TinyEngine(target, speculative_config, max_num_seqs=4) as engine:
        engine.generate(PROMPTS[:1], max_tokens)  # warm-up
        runs = [engine.generate(PROMPTS, max_tokens) for _ in range(repeats)]
    if any(run.token_ids != runs[0].token_ids for run in runs):
        raise RuntimeError("greedy runs of one engine produced different tokens")
    return runs[0], Spread.of([run.tokens_per_s for run in runs])


def main() -> int:
    parser = argparse.ArgumentParser(
        description="Run tiny local models with and without DSpark and compare.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(f"  {name}: {text}" for name, text in PAIRS.items()),
    )
    parser.add_argument("--pair", choices=PAIRS, default="bigram", help="which model pair")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step (1-4)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed runs per engine (median and range)"
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if not 1 <= args.k <= tiny_models.DSparkDraftSpec().block_size:
        parser.error("--k must be between 1 and the tiny draft's block size (4)")

    with tempfile.TemporaryDirectory(prefix="dspark-demo-") as workdir:
        print(f"building tiny models ({args.pair}: {PAIRS[args.pair]})", flush=True)
        target, draft = build_pair(args.pair, Path(workdir))
        print("running vLLM without speculation ...", flush=True)
        plain, plain_speed = generate(target, None, args.max_tokens, args.repeats)
        print("running vLLM with DSpark ...", flush=True)
        dspark, dspark_speed = generate(
            target, dspark_config(draft, k=args.k), args.max_tokens, args.repeats
        )

    for prompt, base, spec in zip(PROMPTS, plain.token_ids, dspark.token_ids, strict=True):
        print(f"\nprompt  {prompt}\nplain   {base[:16]}...\ndspark  {spec[:16]}...")
    equal = plain.token_ids == dspark.token_ids
    print(f"\noutputs equal: {equal}")
    acceptance = ", ".join(f"{n / dspark.drafts:.2f}" for n in dspark.accepted_per_position)
    print("acceptance per position: " + acceptance)
    print(f"tau (tokens per verify step): {dspark.tau:.2f}")
    print(
        f"tokens/s, median of {args.repeats} runs: plain {plain_speed}, dspark {dspark_speed} "
        f"(ratio of medians {dspark_speed.median / plain_speed.median:.2f}; tiny CPU models, "
        "not a GPU speed-up)"
    )
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
