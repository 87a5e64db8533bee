"""See DSpark work on a laptop: tiny local models, vLLM with and without DSpark.

    .venv/bin/python -m dspark_demo [--pair bigram|oracle|random] [--k 4]

Builds a tiny Qwen3 target and a DSpark draft (no hub), generates greedily with
plain vLLM and with DSpark on the V1 runner, and prints both outputs, whether
they are equal, the acceptance per draft position and the tokens per second of
each run. Needs the vLLM that install.py patched.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from dspark_demo import tiny_models

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
    return target, tiny_models.save_dspark_draft(root / "draft", spec, weights)


def generate(target: Path, speculative_config: dict | None, max_tokens: int):
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(target),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        enforce_eager=True,
        disable_log_stats=False,
        speculative_config=speculative_config,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(PROMPTS[:1], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    metrics = {m.name: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics()}
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return tokens, sum(map(len, tokens)) / seconds, metrics


def main() -> int:
    parser = argparse.ArgumentParser(
        description="Run tiny local models with and without DSpark and compare.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(f"  {name}: {text}" for name, text in PAIRS.items()),
    )
    parser.add_argument("--pair", choices=PAIRS, default="bigram", help="which model pair")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step (1-4)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt")
    args = parser.parse_args()
    if not 1 <= args.k <= tiny_models.DSparkDraftSpec().block_size:
        parser.error("--k must be between 1 and the tiny draft's block size (4)")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    with tempfile.TemporaryDirectory(prefix="dspark-demo-") as workdir:
        print(f"building tiny models ({args.pair}: {PAIRS[args.pair]})", flush=True)
        target, draft = build_pair(args.pair, Path(workdir))
        print("running vLLM without speculation ...", flush=True)
        plain, plain_rate, _ = generate(target, None, args.max_tokens)
        print("running vLLM with DSpark ...", flush=True)
        config = {"method": "dspark", "model": str(draft), "num_speculative_tokens": args.k}
        dspark, dspark_rate, metrics = generate(target, config, args.max_tokens)

    for prompt, base, spec in zip(PROMPTS, plain, dspark, strict=True):
        print(f"\nprompt  {prompt}\nplain   {base[:16]}...\ndspark  {spec[:16]}...")
    drafts = metrics["vllm:spec_decode_num_drafts"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    equal = plain == dspark
    print(f"\noutputs equal: {equal}")
    print("acceptance per position: " + ", ".join(f"{n / drafts:.2f}" for n in accepted))
    print(f"tau (tokens per verify step): {1 + sum(accepted) / drafts:.2f}")
    print(
        f"tokens/s: plain {plain_rate:.0f}, dspark {dspark_rate:.0f} "
        f"(ratio {dspark_rate / plain_rate:.2f}; tiny CPU models, not a GPU speed-up)"
    )
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
