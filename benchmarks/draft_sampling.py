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
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_runs import ENGINE_ENV
from dspark_demo import tiny_models

K = 4
METHODS = ("greedy", "probabilistic")


def build_pairs(root: Path) -> dict[str, tuple[Path, Path]]:
    bigram_target = tiny_models.build_qwen3_target(root / "bigram-target", kind="bigram")
    bigram_spec = tiny_models.DSparkDraftSpec(markov_rank=tiny_models.HIDDEN_SIZE)
    bigram_draft = tiny_models.save_dspark_draft(
        root / "bigram-draft",
        bigram_spec,
        tiny_models.bigram_dspark_weights(bigram_spec, bigram_target),
    )
    random_target = tiny_models.build_qwen3_target(root / "random-target")
    random_draft = tiny_models.save_dspark_draft(
        root / "random-draft", tiny_models.DSparkDraftSpec()
    )
    return {"bigram": (bigram_target, bigram_draft), "random": (random_target, random_draft)}


def measure(target: Path, draft: Path, method: str, concurrency: int, max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(target),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=concurrency,
        seed=0,
        enforce_eager=True,
        disable_log_stats=False,
        speculative_config={
            "method": "dspark",
            "model": str(draft),
            "num_speculative_tokens": K,
            "draft_sample_method": method,
        },
    )
    prompts = [f"w{17 * i % 990} w{31 * i % 990} w{7 * i % 990}" for i in range(concurrency * 2)]
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)

    def counters(engine) -> tuple[float, list[float]]:
        drafts, per_pos = 0.0, [0.0] * K
        for metric in engine.get_metrics():
            if metric.name == "vllm:spec_decode_num_drafts":
                drafts += metric.value
            elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                per_pos = [a + b for a, b in zip(per_pos, metric.values, strict=True)]
        return drafts, per_pos

    drafts_before, accepted_before = counters(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    drafts_after, accepted_after = counters(llm)
    del llm
    gc.collect()
    drafts = drafts_after - drafts_before
    accepted = [a - b for a, b in zip(accepted_after, accepted_before, strict=True)]
    return {
        "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outputs) / seconds,
        "acceptance": [a / drafts if drafts else 0.0 for a in accepted],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    os.environ.update(ENGINE_ENV)
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
