# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Train a tiny DSpark (or DFlash) draft on the tiny target's own greedy text.

Random drafts are never accepted, so they cannot reveal a wrong position offset or
a contaminated context; a trained draft can: its acceptance collapses. This script
trains one in plain torch (a few CPU minutes, fixed seed), saves it in the
DeepSpec format vLLM loads, and scores tau = 1 + mean accepted prefix per block on
held-out prompts, in plain torch against the target's greedy continuation and,
with --engine, through the real vLLM engine's spec-decode counters.

    python -m benchmarks.train_tiny_drafter                  # train + torch eval
    python -m benchmarks.train_tiny_drafter --eval-only      # re-score a saved draft
    python -m benchmarks.train_tiny_drafter --engine         # also score it in vLLM
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from benchmarks.draft_reference import BlockLayout, TargetFeatureTap, TorchBlockDraft
from dspark_fixtures.checkpoints.qwen3 import (
    HEAD_DIM,
    NOISE_TOKEN_ID,
    NUM_HEADS,
    NUM_KV_HEADS,
    VOCAB_SIZE,
    DSparkDraftSpec,
    build_qwen3_target,
    load_target,
    random_dspark_weights,
    save_dflash_draft,
    save_dspark_draft,
)

FIRST_WORD_ID = 5  # prompts avoid the special tokens and the noise token


@dataclass
class Corpus:
    """Prompts plus the target's greedy continuation, and the tapped features."""

    token_ids: torch.Tensor  # [N, prompt_len + new_tokens]
    features: torch.Tensor  # [N, prompt_len + new_tokens, nT * H]
    prompt_len: int


@torch.no_grad()
def greedy_continuations(target, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Plain argmax decoding (EOS is just a token, as with vLLM's ignore_eos)."""
    output = target(input_ids=prompts, use_cache=True)
    sequence, cache = prompts, output.past_key_values
    for _ in range(new_tokens):
        next_token = output.logits[:, -1].argmax(-1, keepdim=True)
        sequence = torch.cat([sequence, next_token], dim=1)
        output = target(input_ids=next_token, past_key_values=cache, use_cache=True)
        cache = output.past_key_values
    return sequence


def random_prompts(count: int, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_WORD_ID, VOCAB_SIZE, (count, length), generator=generator)


def build_corpus(target, spec: DSparkDraftSpec, count: int, args, seed: int) -> Corpus:
    prompts = random_prompts(count, args.prompt_len, seed)
    tap = TargetFeatureTap(target, spec.target_layer_ids)
    token_chunks, feature_chunks = [], []
    for chunk in prompts.split(256):
        tokens = greedy_continuations(target, chunk, args.new_tokens)
        token_chunks.append(tokens)
        feature_chunks.append(tap.features(tokens))
    return Corpus(torch.cat(token_chunks), torch.cat(feature_chunks), args.prompt_len)


def make_draft(target, weights: dict[str, torch.Tensor]) -> TorchBlockDraft:
    return TorchBlockDraft(
        weights,
        embed_tokens=target.model.embed_tokens.weight,
        lm_head=target.lm_head.weight,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        noise_token_id=NOISE_TOKEN_ID,
    )


def init_from_target(weights: dict[str, torch.Tensor], target, spec: DSparkDraftSpec) -> None:
    """Start every draft layer as a copy of the target's last decoder layer, reading
    the features of the layer before it: the draft then begins as the target's own
    last step on the anchor's context, which training refines."""
    last = len(target.model.layers) - 1
    if last - 1 not in spec.target_layer_ids:
        raise ValueError(f"--init-from-target needs target layer {last - 1} among the taps")
    layer = {name: w.detach() for name, w in target.model.layers[last].state_dict().items()}
    for i in range(spec.num_layers):
        for name, w in layer.items():
            weights[f"layers.{i}.{name}"] = w.clone()
    hidden = target.config.hidden_size
    fc = torch.zeros_like(weights["fc.weight"])
    tap = spec.target_layer_ids.index(last - 1)
    fc[:, tap * hidden : (tap + 1) * hidden] = torch.eye(hidden)
    weights["fc.weight"] = fc
    weights["hidden_norm.weight"] = layer["input_layernorm.weight"].clone()
    weights["norm.weight"] = target.model.norm.weight.detach().clone()


def train(draft: TorchBlockDraft, corpus: Corpus, layout: BlockLayout, args) -> list[float]:
    """Random anchors over the generated part; cross-entropy on every prediction,
    weighted by position."""
    generator = torch.Generator().manual_seed(args.seed)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.steps)
    num_seqs, seq_len = corpus.token_ids.shape
    k = layout.num_draft_tokens
    low, high = corpus.prompt_len - 1, seq_len - 2 - k  # c and all k targets generated
    # A draft counts only up to its first miss, so early positions weigh more.
    position_weights = torch.exp(-torch.arange(k) / args.position_decay)
    position_weights /= position_weights.sum()
    losses = []
    for step in range(args.steps):
        rows = torch.randint(0, num_seqs, (args.batch,), generator=generator)
        anchors = torch.randint(low, high + 1, (args.batch, args.anchors), generator=generator)
        tokens, features = corpus.token_ids[rows], corpus.features[rows]
        logits = draft.teacher_forced_logits(features, tokens, anchors, layout)
        target_positions = anchors[..., None] + 2 + torch.arange(k)
        labels = torch.gather(tokens, 1, target_positions.flatten(1)).view_as(target_positions)
        per_token = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none")
        loss = (per_token.view_as(labels) * position_weights).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}", flush=True)
    return losses


@dataclass
class TauReport:
    """Acceptance of greedy drafts against the target's greedy continuation."""

    tau: float
    blocks: int
    acceptance_per_pos: list[float]


def simulate_acceptance(draft: TorchBlockDraft, corpus: Corpus, layout: BlockLayout) -> TauReport:
    """Replays speculative decoding: after each verify the anchor moves past the
    accepted drafts and the correction token, as in the engine."""
    k = layout.num_draft_tokens
    num_seqs, seq_len = corpus.token_ids.shape
    first, last = corpus.prompt_len - 1, seq_len - 2 - k
    anchors = torch.arange(first, last + 1).expand(num_seqs, -1)
    drafts = draft.draft(corpus.features, corpus.token_ids, anchors, layout)  # [N, n, k]
    truth_positions = anchors[..., None] + 2 + torch.arange(k)
    truth = torch.gather(corpus.token_ids, 1, truth_positions.flatten(1)).view_as(truth_positions)
    accepted_prefix = (drafts == truth).int().cumprod(-1).sum(-1)  # [N, n]
    lengths = []
    for row in range(num_seqs):
        anchor = first
        while anchor <= last:
            accepted = int(accepted_prefix[row, anchor - first])
            lengths.append(accepted)
            anchor += accepted + 1
    per_pos = [sum(n > i for n in lengths) / len(lengths) for i in range(k)]
    return TauReport(
        tau=1 + sum(lengths) / len(lengths), blocks=len(lengths), acceptance_per_pos=per_pos
    )


def foreign_context(corpus: Corpus, keep_recent: int) -> Corpus:
    """Each sequence's target features older than `keep_recent` positions come from
    another sequence: what a draft sees when its context window holds a stale or
    foreign request's entries."""
    features = corpus.features.clone()
    other = torch.roll(torch.arange(len(features)), 1)
    features[:, :-keep_recent] = corpus.features[other, :-keep_recent]
    return Corpus(corpus.token_ids, features, corpus.prompt_len)


def fault_sensitivity(draft: TorchBlockDraft, corpus: Corpus, layout: BlockLayout) -> dict:
    """Tau under injected faults: which bugs this trained draft can reveal."""
    faults = {
        "block_rope_positions_plus_1": (replace(layout, block_start_shift=1), corpus),
        "block_rope_positions_minus_1": (replace(layout, block_start_shift=-1), corpus),
        "context_older_than_12_from_another_request": (layout, foreign_context(corpus, 12)),
    }
    if layout.sample_from_anchor:
        dflash_slots = BlockLayout(layout.num_draft_tokens, sample_from_anchor=False)
        faults["predictions_read_one_slot_later"] = (dflash_slots, corpus)
    return {name: simulate_acceptance(draft, c, lay).tau for name, (lay, c) in faults.items()}


def engine_tau(target_dir: Path, draft_dir: Path, method: str, corpus: Corpus, k: int) -> dict:
    """Tau of the saved draft inside vLLM, from its spec-decode counters."""
    from dspark_fixtures.engine import EngineUnavailable, run_engine

    prompts = [row[: corpus.prompt_len].tolist() for row in corpus.token_ids]
    new_tokens = corpus.token_ids.shape[1] - corpus.prompt_len
    spec_config = {"method": method, "model": str(draft_dir), "num_speculative_tokens": k}
    try:
        run = run_engine(target_dir, prompts, new_tokens, spec_config, max_num_seqs=8)
    except EngineUnavailable as exc:
        return {"available": False, "reason": str(exc)}
    expected = [row[corpus.prompt_len :].tolist() for row in corpus.token_ids]
    same = sum(got == want for got, want in zip(run.token_ids, expected, strict=True))
    return {
        "available": True,
        "tau": run.tau,
        "acceptance_per_pos": [a / run.drafts for a in run.accepted_per_position],
        "outputs_equal_torch_greedy": f"{same}/{len(expected)}",
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_dir = Path("benchmarks/results/tiny")
    parser.add_argument("--out", type=Path, default=default_dir, help="target + drafts go here")
    parser.add_argument("--method", choices=["dspark", "dflash"], default="dspark")
    parser.add_argument("--k", type=int, default=4, help="drafted tokens per block")
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=32, help="sequences per step")
    parser.add_argument("--anchors", type=int, default=16, help="anchors per sequence")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--position-decay", type=float, default=2.0, help="loss weight exp(-j / decay)"
    )
    parser.add_argument("--train-seqs", type=int, default=2048)
    parser.add_argument("--eval-seqs", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (tiny ops: 1 is fastest)"
    )
    parser.add_argument(
        "--random-init", action="store_true", help="do not start from the target's last layer"
    )
    parser.add_argument("--eval-only", action="store_true", help="score the saved draft")
    parser.add_argument("--engine", action="store_true", help="also score it in vLLM")
    parser.add_argument(
        "--sensitivity", action="store_true", help="also score it under injected faults"
    )
    args = parser.parse_args(argv)
    if args.prompt_len + args.new_tokens > 256:
        parser.error("--prompt-len + --new-tokens must fit the engine's 256-token context")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    spec = DSparkDraftSpec(block_size=args.k)
    layout = BlockLayout(args.k, sample_from_anchor=args.method == "dspark")
    target_dir, draft_dir = args.out / "target", args.out / f"{args.method}_draft"
    if not (target_dir / "config.json").exists():
        build_qwen3_target(target_dir)
    target = load_target(target_dir)

    started = time.perf_counter()
    eval_corpus = build_corpus(target, spec, args.eval_seqs, args, seed=args.seed + 10_000)
    report: dict = {"method": args.method, "k": args.k, "draft_dir": str(draft_dir)}
    if args.eval_only:
        if not (draft_dir / "model.safetensors").exists():
            print(
                f"error: no trained draft in {draft_dir}; run without --eval-only first",
                file=sys.stderr,
            )
            return 2
        weights = load_file(str(draft_dir / "model.safetensors"))
    else:
        weights = random_dspark_weights(spec)
        if not args.random_init:
            init_from_target(weights, target, spec)
        if args.method == "dflash":
            weights = {n: w for n, w in weights.items() if not n.startswith("markov_head.")}
        untrained = simulate_acceptance(make_draft(target, weights), eval_corpus, layout)
        report["untrained"] = asdict(untrained)
        corpus = build_corpus(target, spec, args.train_seqs, args, seed=args.seed)
        draft = make_draft(target, weights)
        losses = train(draft, corpus, layout, args)
        weights = draft.state_dict_deepspec()
        if args.method == "dspark":
            save_dspark_draft(draft_dir, spec, weights, target_dir)
        else:
            save_dflash_draft(draft_dir, spec, weights)
        report["final_loss"] = losses[-1]
        report["train_seconds"] = time.perf_counter() - started
    trained = simulate_acceptance(make_draft(target, weights), eval_corpus, layout)
    report["torch_eval"] = asdict(trained)
    print(
        f"torch eval on {args.eval_seqs} held-out prompts: tau {trained.tau:.2f} "
        f"(k={args.k}, {trained.blocks} blocks), acceptance per position "
        + " ".join(f"{p:.2f}" for p in trained.acceptance_per_pos)
    )
    if args.sensitivity:
        report["fault_sensitivity"] = fault_sensitivity(
            make_draft(target, weights), eval_corpus, layout
        )
        for fault, tau in report["fault_sensitivity"].items():
            print(f"  with fault {fault}: tau {tau:.2f}")
    if args.engine:
        report["engine_eval"] = engine_tau(target_dir, draft_dir, args.method, eval_corpus, args.k)
        print("vLLM engine eval:", json.dumps(report["engine_eval"]))
    (args.out / f"{args.method}_report.json").write_text(json.dumps(report, indent=2))
    print(f"saved draft in {draft_dir}; report in {args.out / f'{args.method}_report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
