"""Confidence-scheduled verification side by side on the CPU engine.

    .venv/bin/python -m benchmarks.confidence_scheduling [--repeats 3] [--concurrency 1 4 8]

Runs the same prompts with DSpark and the confidence scheduler off, threshold
and hardware, alternating the schedulers within each repeat (machines here are
noisy), and prints per scheduler and concurrency: median generated tokens/s,
tau (tokens per verify step), drafts verified per step, and the ratio of
tokens/s to `off`. The draft is the tiny bigram pair with a confidence head
that says 0.5 everywhere: it shows what shortening verification does to speed
and acceptance on this machine, not what a trained confidence head would gain
on a GPU. On a CPU with tiny models the target's step cost barely grows with
the verified rows, so shorter verification mainly loses accepted tokens here.
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

from dspark_demo import tiny_models
from dspark_demo.engine import ENGINE_ENV

SCHEDULERS = {
    "off": {},
    "threshold-0.2": {"confidence_scheduler": "threshold", "confidence_threshold": 0.2},
    "hardware": {"confidence_scheduler": "hardware", "step_rate_curve": "1:100,8:80,32:50"},
}
K = 4


def build_models(root: Path) -> tuple[Path, Path]:
    target = tiny_models.build_qwen3_target(root / "target", kind="bigram")
    spec = tiny_models.DSparkDraftSpec(
        markov_rank=tiny_models.HIDDEN_SIZE, confidence_head=True, confidence_with_markov=True
    )
    weights = tiny_models.bigram_dspark_weights(spec, target)
    # Zero weight, zero bias: every confidence is sigmoid(0) = 0.5.
    weights["confidence_head.proj.weight"].zero_()
    weights["confidence_head.proj.bias"].zero_()
    return target, tiny_models.save_dspark_draft(root / "draft", spec, weights, target)


def measure(target: Path, draft: Path, options: dict, concurrency: int, max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(target),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=concurrency,
        enforce_eager=True,
        disable_log_stats=False,
        speculative_config={
            "method": "dspark",
            "model": str(draft),
            "num_speculative_tokens": K,
            "dspark_options": options,
        },
    )
    prompts = [f"w{17 * i % 990} w{31 * i % 990} w{7 * i % 990}" for i in range(concurrency * 2)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)
    before = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    del llm
    gc.collect()

    def delta(name: str) -> float:
        return (after.get(name) or 0) - (before.get(name) or 0)

    drafts = delta("vllm:spec_decode_num_drafts")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "tokens_per_s": tokens / seconds,
        "tau": 1 + delta("vllm:spec_decode_num_accepted_tokens") / drafts if drafts else 1.0,
        "verified_per_step": delta("vllm:spec_decode_num_draft_tokens") / drafts if drafts else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    os.environ.update(ENGINE_ENV)
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
