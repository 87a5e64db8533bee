# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""See DSpark work on a CPU: a tiny target and draft, vLLM with and without DSpark.

    python -m dspark_demo [--pair bigram|oracle|random] [--k 4] [--save DIR] [--verbose]

Builds a tiny Qwen3 target and a DSpark draft for it (no download), generates greedily with
plain vLLM and with DSpark on the V1 runner, and prints both outputs as text, whether they are
equal, the acceptance per draft position, tau, and the speed of each: the median of several
timed runs with their spread (one sub-second run on a shared CPU varies by 100x), split into
tokens per engine step and time per step. vLLM's own logs go to a file unless --verbose.
Needs the vLLM that install.py patched; says so in one line otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dspark_common.operator_input import escaped
from dspark_demo import quiet
from dspark_demo.saved_pair import (
    SaveFailed,
    add_chat_template,
    save_pair,
    save_problem,
    serve_command,
)
from dspark_fixtures.checkpoints import qwen3

if TYPE_CHECKING:
    from dspark_fixtures.engine import EngineRun

REPOSITORY = Path(__file__).resolve().parents[1]
PAIRS = {
    "bigram": "the target's next word depends only on the current one, and the draft's Markov "
    "head knows that table, blurred: often right, not always",
    "oracle": "the target always answers <unk> (its output head is all zeros, every word ties "
    "and greedy decoding takes token 0), and the draft shares that head: always right",
    "random": "random weights in both: the draft is almost never right, and the output is "
    "still the target's own",
}
PROMPTS = [
    "w12 w7 w300 w41 w5",
    "w900 w901 w902 w903 w904 w905 w906 w907",
    "w1 w2 w3",
    "w500 w42 w42 w42 w7 w8 w9 w10 w11 w12 w13 w14",
]
WORDS_SHOWN = 12
WIDTH = 92


def build_pair(pair: str, root: Path, chat_template: bool = False) -> tuple[Path, Path]:
    """A target and a draft written in DeepSpec's layout; `chat_template`: the target's
    tokenizer gets one, for `vllm serve`'s chat endpoint."""
    spec = qwen3.DSparkDraftSpec()
    if pair == "bigram":
        target = qwen3.build_qwen3_target(root / "target", kind="bigram")
        spec = qwen3.DSparkDraftSpec(markov_rank=qwen3.HIDDEN_SIZE)
        weights = qwen3.bigram_dspark_weights(spec, target)
    elif pair == "oracle":
        target = qwen3.build_qwen3_target(root / "target", kind="zero-lm-head")
        weights = qwen3.oracle_dspark_weights(spec)
    else:
        target = qwen3.build_qwen3_target(root / "target")
        weights = qwen3.random_dspark_weights(spec)
    if chat_template:
        add_chat_template(target)
    return target, qwen3.save_dspark_draft(root / "draft", spec, weights, target)


@dataclass(frozen=True)
class Spread:
    """Median and range of repeated measurements."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        if not values:
            raise ValueError("no measurements")
        return cls(statistics.median(values), min(values), max(values))

    def __str__(self) -> str:
        return f"{self.median:.0f} (range {self.low:.0f}-{self.high:.0f})"


@dataclass(frozen=True)
class Measured:
    """One engine's greedy output and speed."""

    run: EngineRun
    speed: Spread
    """Tokens per second over the timed runs."""

    @property
    def tokens(self) -> int:
        return sum(len(tokens) for tokens in self.run.token_ids)

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / len(self.run.steps)

    @property
    def ms_per_step(self) -> float:
        """At the median speed."""
        return 1000 * self.tokens / self.speed.median / len(self.run.steps)


def generate(
    target: Path, speculative_config: dict | None, max_tokens: int, repeats: int
) -> Measured:
    """The first timed run, and tokens/s over ``repeats`` timed runs (greedy: each run must
    produce the same tokens)."""
    from dspark_fixtures.engine import TinyEngine

    with TinyEngine(target, speculative_config, record=True, max_num_seqs=4) as engine:
        engine.generate(PROMPTS[:1], max_tokens)  # warm-up
        runs = [engine.generate(PROMPTS, max_tokens) for _ in range(repeats)]
    if any(run.token_ids != runs[0].token_ids for run in runs):
        raise RuntimeError("greedy runs of one engine produced different tokens")
    return Measured(runs[0], Spread.of([run.tokens_per_s for run in runs]))


def shown_python() -> str:
    """This interpreter as the user would type it."""
    relative = os.path.relpath(sys.executable)
    return relative if not relative.startswith("..") else sys.executable


def dspark_missing() -> str | None:
    """Why this Python's vLLM cannot run DSpark (one line), or None: ``install.py --status``
    with this interpreter, before anything slow."""
    done = subprocess.run(
        [sys.executable, str(REPOSITORY / "install.py"), "--status", "--json"],
        capture_output=True,
        text=True,
    )
    try:
        status = json.loads(done.stdout)
    except ValueError:
        status = {"state": "error", "error": done.stderr.strip() or f"exit {done.returncode}"}
    if status.get("state") == "installed":
        return None
    if status.get("state") == "error":
        return f"{status.get('error')} (a CPU setup: docs/cpu-serving.md)"
    return (
        f"DSpark is not installed in this Python's vLLM ({status.get('vllm_path')}: "
        f"{status.get('state')}). Run: {shown_python()} install.py"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m dspark_demo",
        description="Run a tiny target and its DSpark draft in vLLM, without and with DSpark,\n"
        "and compare the outputs, the acceptance and the speed.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="pairs:\n"
        + "\n".join(
            textwrap.fill(text, WIDTH, initial_indent=f"  {name}: ", subsequent_indent="    ")
            for name, text in PAIRS.items()
        ),
    )
    parser.add_argument(
        "--pair", choices=PAIRS, default="bigram", help="which model pair (default: %(default)s)"
    )
    parser.add_argument(
        "--k", type=int, default=4, help="draft tokens per step, 1-4 (default: %(default)s)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="tokens per prompt (default: %(default)s)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed runs per engine: median and range (default: %(default)s)",
    )
    parser.add_argument(
        "--save",
        type=Path,
        metavar="DIR",
        help="keep the pair in DIR (target/ with a chat template, draft/) for vllm serve "
        "(default: build it in a temporary directory and delete it)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show vLLM's logs (default: they go to a file, shown on failure)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    if not 1 <= args.k <= qwen3.DSparkDraftSpec().block_size:
        parser.error("--k must be between 1 and the tiny draft's block size (4)")
    problem = save_problem(args.save) if args.save is not None else None
    if problem:
        parser.error(f"--save {problem}")
    return args


def words(token_ids: list[int], decode) -> str:
    shown = decode(token_ids[:WORDS_SHOWN])
    return shown + (f" ... ({len(token_ids)} tokens)" if len(token_ids) > WORDS_SHOWN else "")


def report(args: argparse.Namespace, target: Path, plain: Measured, dspark: Measured) -> bool:
    """Print the comparison; True when the outputs are equal."""
    from transformers import AutoTokenizer

    decode = AutoTokenizer.from_pretrained(str(target)).decode
    for prompt, base, spec in zip(PROMPTS, plain.run.token_ids, dspark.run.token_ids, strict=True):
        print(f"\nprompt  {prompt}\nplain   {words(base, decode)}\ndspark  {words(spec, decode)}")
    equal = plain.run.token_ids == dspark.run.token_ids
    count = f"{len(PROMPTS)} prompts x {args.max_tokens} tokens"
    print(f"\noutputs equal: {'yes, token for token' if equal else 'NO'} ({count})")
    if args.pair == "oracle":
        print("  (<unk> is token 0: the oracle target's zero output head makes every word tie)")
    run = dspark.run
    acceptance = ", ".join(f"{n / run.drafts:.2f}" for n in run.accepted_per_position)
    print(f"acceptance per position: {acceptance}")
    print(
        f"tau: {run.tau:.2f} tokens per verification step (plain decoding: 1; at most {args.k + 1})"
    )
    runs = f"{args.repeats} run{'s' if args.repeats > 1 else ''}"
    print(
        f"tokens/s, median of {runs}: plain {plain.speed}, dspark {dspark.speed}: "
        f"{dspark.speed.median / plain.speed.median:.2f}x\n"
        f"  per engine step: plain {plain.tokens_per_step:.1f} tokens in "
        f"{plain.ms_per_step:.1f} ms; dspark {dspark.tokens_per_step:.1f} tokens in "
        f"{dspark.ms_per_step:.1f} ms"
    )
    why = (
        "This is not DSpark's speed-up: a DSpark step yields "
        f"{dspark.tokens_per_step / plain.tokens_per_step:.1f}x the tokens of a plain step but "
        f"takes {dspark.ms_per_step / plain.ms_per_step:.1f}x as long (it verifies k + 1 tokens "
        "per request and adds a draft pass), and this tiny draft has as many layers as the tiny "
        "target, so its pass costs about what a target pass costs. DSpark gains where a draft "
        "pass is a small fraction of a target step (a large target on a GPU). What this run "
        "shows: equal outputs, and how often the drafts are accepted."
    )
    print(textwrap.fill(why, WIDTH, initial_indent="  ", subsequent_indent="  "))
    return equal


def run(args: argparse.Namespace, scratch: Path, log: Path | None) -> int:
    from dspark_fixtures.engine import dspark_config

    def step(what: str) -> contextlib.AbstractContextManager:
        print(what, flush=True)
        return quiet.output_to(log) if log else contextlib.nullcontext()

    pair = f"The pair: a tiny 2-layer Qwen3 target and a DSpark draft for it ({PAIRS[args.pair]})."
    print(
        textwrap.fill(pair, WIDTH, subsequent_indent="  ")
        + "\nacceptance per position: how often the target accepted the draft's 1st, 2nd, ... "
        "token.\ntau: tokens the target emits per verification step (1 + accepted drafts, at "
        f"most k + 1 = {args.k + 1}).\n"
    )
    try:
        with step("building the tiny pair ..."):
            if args.save:
                target, draft = save_pair(args.save, lambda root: build_pair(args.pair, root, True))
            else:
                target, draft = build_pair(args.pair, scratch)
        with step("running vLLM without speculation ..."):
            plain = generate(target, None, args.max_tokens, args.repeats)
        with step(f"running vLLM with DSpark (k={args.k}) ..."):
            dspark = generate(target, dspark_config(draft, k=args.k), args.max_tokens, args.repeats)
    except SaveFailed as error:
        print(f"dspark_demo: {error}", file=sys.stderr)
        return 1
    except Exception as error:
        if log:
            print(f"--- the last lines of vLLM's log:\n{quiet.tail(log)}\n---", file=sys.stderr)
        print(f"dspark_demo: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    equal = report(args, target, plain, dspark)
    if args.save:
        print(
            f"\nsaved the pair in {args.save}: target/ (with a chat template) and draft/. "
            f"Serve it (docs/cpu-serving.md):\n  {serve_command(target, draft, args.k)}"
        )
    return 0 if equal else 1


def saved_note(save: Path | None) -> str:
    """What an interrupted run left in --save's folder: the pair is renamed there complete, or
    not at all."""
    if save is None:
        return ""
    if (save / "draft").is_dir():
        return f"; the pair was complete and stays in {escaped(str(save))}"
    return "; nothing was saved"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = dspark_missing()
    if missing:
        print(f"dspark_demo: {missing}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="dspark-demo-") as scratch:
        log = None if args.verbose else Path(scratch) / "vllm.log"
        try:
            return run(args, Path(scratch), log)
        except KeyboardInterrupt:
            print(f"dspark_demo: interrupted{saved_note(args.save)}", file=sys.stderr)
            return 130


if __name__ == "__main__":
    sys.exit(main())
