"""Side-by-side speed of no speculation, upstream DFlash and DSpark on the real vLLM
CPU engine, with tiny local models.

Every method sees the same prompts and the same greedy sampling. Draft kinds:
  * oracle: the target's lm_head is zero, so greedy decoding emits token 0 forever
    and every draft is accepted (DSpark's Markov projection is zeroed too, or it
    would break the tie) -- the ceiling of what speculation can buy here;
  * random: independent random draft weights, so drafts are (almost) never
    accepted -- the cost of speculating for nothing;
  * trained (opt-in): the drafts `train_tiny_drafter` wrote, on its target.
Runs alternate method by method within each round (A B C, A B C, ...) and the
report gives medians over rounds and repeats, because shared CPUs are noisy.

    python -m benchmarks.cpu_side_by_side                      # all methods
    python -m benchmarks.cpu_side_by_side --drafts oracle,random,trained
    python -m benchmarks.cpu_side_by_side --methods nospec,dflash --rounds 2

`dspark` needs this project's patched vLLM; on a stock vLLM the harness reports it
as unavailable (with vLLM's reason) and measures the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark_demo.engine import EngineRun, EngineUnavailable, TinyEngine
from dspark_demo.host_syncs import HostSyncRecorder
from dspark_demo.tiny_models import (
    VOCAB_SIZE,
    DSparkDraftSpec,
    build_qwen3_target,
    oracle_dspark_weights,
    random_dspark_weights,
    save_dflash_draft,
    save_dspark_draft,
)

METHODS = ("nospec", "dflash", "dspark")
DRAFT_KINDS = ("oracle", "random", "trained")
PROMPT_LEN = 16


@dataclass(frozen=True)
class Setup:
    """One engine configuration: a draft kind, a method and k (0 for nospec)."""

    draft_kind: str
    method: str
    k: int

    @property
    def label(self) -> str:
        return self.method if self.method == "nospec" else f"{self.method} k={self.k}"


@dataclass
class Samples:
    """Per-concurrency measurements of one setup across rounds."""

    tokens_per_s: dict[int, list[float]] = field(default_factory=dict)
    results: dict[int, list[EngineRun]] = field(default_factory=dict)
    host_syncs_per_step: list[str] = field(default_factory=list)

    def add(self, concurrency: int, result: EngineRun) -> None:
        self.tokens_per_s.setdefault(concurrency, []).append(result.tokens_per_s)
        self.results.setdefault(concurrency, []).append(result)


def trained_models(trained_dir: Path) -> dict[str, Path]:
    """The target and drafts written by `train_tiny_drafter --out trained_dir`."""
    models = {"target": trained_dir / "target"}
    for method in ("dspark", "dflash"):
        if (trained_dir / f"{method}_draft" / "model.safetensors").exists():
            models[method] = trained_dir / f"{method}_draft"
    return models


def build_models(root: Path) -> dict[str, dict[str, Path]]:
    """Targets and drafts per draft kind: {kind: {"target", "dflash", "dspark"}}."""
    spec = DSparkDraftSpec()
    models: dict[str, dict[str, Path]] = {}
    for kind, target_kind, weights in (
        ("oracle", "zero-lm-head", oracle_dspark_weights(spec)),
        ("random", "random", random_dspark_weights(spec)),
    ):
        target = root / f"{kind}_target"
        if not (target / "config.json").exists():
            build_qwen3_target(target, kind=target_kind)
        models[kind] = {
            "target": target,
            "dspark": save_dspark_draft(root / f"{kind}_dspark", spec, weights, target),
            "dflash": save_dflash_draft(root / f"{kind}_dflash", spec, weights),
        }
    return models


def fixed_prompts(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(5, VOCAB_SIZE, (count, PROMPT_LEN), generator=generator).tolist()


def measure(
    engine: TinyEngine, prompts: list[list[int]], concurrencies: list[int], args: argparse.Namespace
) -> list[tuple[int, EngineRun]]:
    """A warm-up at the top concurrency, then `--repeats` timed calls per level,
    interleaved level by level."""
    engine.generate(prompts[: max(concurrencies)], 8)  # warm-up, not measured
    return [
        (c, engine.generate(prompts[:c], args.max_tokens))
        for _ in range(args.repeats)
        for c in concurrencies
    ]


def host_syncs_per_step(engine: TinyEngine, prompts: list[list[int]]) -> list[str]:
    """The ops that would make the host wait for the GPU in the drafter's step,
    over the draft steps of one warm generate call (dspark_demo/host_syncs.py)."""
    drafter = engine.model_runner.drafter
    propose = drafter.propose
    per_step: list[list[str]] = []

    def recorded_propose(*args, **kwargs):
        with HostSyncRecorder() as recorder:
            result = propose(*args, **kwargs)
        per_step.append(recorder.syncs)
        return result

    drafter.propose = recorded_propose
    try:
        engine.generate(prompts, 32)
    finally:
        drafter.propose = propose
    return max(per_step, key=len)


def spec_config(setup: Setup, models: dict[str, dict[str, Path]]) -> dict | None:
    if setup.method == "nospec":
        return None
    draft = models[setup.draft_kind][setup.method]
    return {"method": setup.method, "model": str(draft), "num_speculative_tokens": setup.k}


def summarize(setup: Setup, samples: Samples, reference: Samples | None) -> dict:
    """Medians over all timed calls; acceptance from the counters summed over them."""
    rows = {}
    for concurrency, speeds in samples.tokens_per_s.items():
        results = samples.results[concurrency]
        drafts = sum(r.drafts for r in results)
        accepted = sum(r.metrics.get("vllm:spec_decode_num_accepted_tokens", 0) for r in results)
        width = max((len(r.accepted_per_position) for r in results), default=0)
        per_pos = (
            [
                sum(r.accepted_per_position[i] for r in results if i < len(r.accepted_per_position))
                / drafts
                for i in range(width)
            ]
            if drafts
            else []
        )
        row = {
            "tokens_per_s_median": statistics.median(speeds),
            # Best of N: the least-disturbed call, for boxes shared with other work.
            "tokens_per_s_best": max(speeds),
            "tokens_per_s_samples": speeds,
            "tau": 1 + accepted / drafts if drafts else None,
            "acceptance_per_pos": per_pos,
        }
        if reference is not None:
            want = reference.results[concurrency][0].token_ids
            row["outputs_equal_nospec"] = all(r.token_ids == want for r in results)
        rows[str(concurrency)] = row
    return {
        "draft_kind": setup.draft_kind,
        "method": setup.method,
        "k": setup.k,
        "by_concurrency": rows,
        "host_syncs_worst_step": samples.host_syncs_per_step,
    }


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


RATIO_STATISTICS = ("median", "best")


def ratios(summaries: dict[Setup, dict], draft_kind: str, k: int, concurrency: int) -> dict:
    """Speed ratios per statistic: {"median": {...}, "best": {...}}."""

    def speed(method: str, method_k: int, statistic: str) -> float | None:
        summary = summaries.get(Setup(draft_kind, method, method_k))
        if summary is None:
            return None
        return summary["by_concurrency"][str(concurrency)][f"tokens_per_s_{statistic}"]

    by_statistic = {}
    for statistic in RATIO_STATISTICS:
        nospec = speed("nospec", 0, statistic)
        dflash, dspark = speed("dflash", k, statistic), speed("dspark", k, statistic)
        by_statistic[statistic] = {
            "dspark_over_nospec": _ratio(dspark, nospec),
            "dspark_over_dflash": _ratio(dspark, dflash),
            "dflash_over_nospec": _ratio(dflash, nospec),
        }
    return by_statistic


def vllm_version() -> str:
    from vllm import __version__

    return __version__


def run(args: argparse.Namespace) -> dict:
    models = build_models(args.out / "models")
    if "trained" in args.drafts:
        models["trained"] = trained_models(args.trained_dir)
    prompts = fixed_prompts(max(args.concurrency))
    setups = [
        Setup(kind, method, 0 if method == "nospec" else k)
        for kind in args.drafts
        for method in args.methods
        for k in ([0] if method == "nospec" else args.k)
    ]
    samples = {setup: Samples() for setup in setups}
    unavailable: dict[str, str] = {}
    for round_index in range(args.rounds):
        for setup in setups:
            if setup.method in unavailable:
                continue
            if setup.method != "nospec" and setup.method not in models[setup.draft_kind]:
                unavailable[f"{setup.draft_kind} {setup.method}"] = (
                    f"no trained {setup.method} draft in {args.trained_dir}: run "
                    f"`python -m benchmarks.train_tiny_drafter --method {setup.method}` first"
                )
                continue
            print(
                f"round {round_index + 1}/{args.rounds}: {setup.draft_kind} {setup.label}",
                flush=True,
            )
            try:
                engine = TinyEngine(
                    models[setup.draft_kind]["target"],
                    spec_config(setup, models),
                    max_num_seqs=max(args.concurrency),
                )
            except EngineUnavailable as exc:
                unavailable[setup.method] = str(exc)
                print(f"  {setup.method} UNAVAILABLE in this vLLM: {exc}", flush=True)
                continue
            try:
                for concurrency, result in measure(engine, prompts, args.concurrency, args):
                    samples[setup].add(concurrency, result)
                if setup.method != "nospec" and round_index == 0:
                    samples[setup].host_syncs_per_step = host_syncs_per_step(
                        engine, prompts[: max(args.concurrency)]
                    )
            finally:
                engine.close()

    summaries = {}
    for setup in setups:
        if samples[setup].tokens_per_s:
            reference = samples.get(Setup(setup.draft_kind, "nospec", 0))
            reference = reference if reference and reference.results else None
            summaries[setup] = summarize(setup, samples[setup], reference)
    comparisons = [
        {"draft_kind": kind, "k": k, "concurrency": c, **ratios(summaries, kind, k, c)}
        for kind in args.drafts
        for k in args.k
        for c in args.concurrency
    ]
    return {
        "meta": {
            "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "cpus": len(os.sched_getaffinity(0)),
            "load_average_1_5_15_at_end": os.getloadavg(),
            "vllm": vllm_version(),
            "torch": torch.__version__,
            "rounds": args.rounds,
            "repeats": args.repeats,
            "max_tokens": args.max_tokens,
            "prompt_len": PROMPT_LEN,
            "timing": "tokens/s = generated tokens / wall time of one LLM.generate call "
            "holding `concurrency` prompts; median over rounds x repeats",
        },
        "unavailable": unavailable,
        "results": list(summaries.values()),
        "ratios": comparisons,
    }


def _times(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def format_report(report: dict) -> str:
    lines = []
    for method, reason in report["unavailable"].items():
        lines.append(f"{method}: UNAVAILABLE ({reason}); no figures reported for it")
    lines.append(
        f"{'drafts':<7} {'method':<11} {'C':>2} {'median tok/s':>12} {'best tok/s':>10} "
        f"{'tau':>5}  acceptance/pos"
    )
    for summary in report["results"]:
        label = summary["method"] + ("" if summary["method"] == "nospec" else f" k={summary['k']}")
        for concurrency, row in summary["by_concurrency"].items():
            tau = "-" if row["tau"] is None else f"{row['tau']:.2f}"
            per_pos = " ".join(f"{p:.2f}" for p in row["acceptance_per_pos"])
            lines.append(
                f"{summary['draft_kind']:<7} {label:<11} {concurrency:>2} "
                f"{row['tokens_per_s_median']:>12.1f} {row['tokens_per_s_best']:>10.1f} "
                f"{tau:>5}  {per_pos}"
            )
    lines.append("")
    lines.append("host-sync ops in the worst draft step (would block on a GPU)")
    for summary in report["results"]:
        if summary["method"] != "nospec":
            syncs = summary["host_syncs_worst_step"]
            lines.append(
                f"{summary['draft_kind']:<7} {summary['method']} k={summary['k']}: "
                f"{len(syncs)} {' '.join(syncs)}"
            )
    lines.append("")
    lines.append("speed ratios, median (best of N)")
    lines.append(
        f"{'drafts':<7} {'k':>2} {'C':>2} {'DSpark/nospec':>16} {'DSpark/DFlash':>16} "
        f"{'DFlash/nospec':>16}"
    )
    for r in report["ratios"]:
        cells = [
            f"{_times(r['median'][key])} ({_times(r['best'][key])})"
            for key in ("dspark_over_nospec", "dspark_over_dflash", "dflash_over_nospec")
        ]
        lines.append(
            f"{r['draft_kind']:<7} {r['k']:>2} {r['concurrency']:>2} "
            + " ".join(f"{cell:>16}" for cell in cells)
        )
    return "\n".join(lines)


def plot(report: dict, path: Path) -> bool:
    """tokens/s per setup and concurrency, and acceptance per position; False
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    kinds = sorted({s["draft_kind"] for s in report["results"]})
    fig, axes = plt.subplots(2, len(kinds), figsize=(6 * len(kinds), 8), squeeze=False)
    for column, kind in enumerate(kinds):
        summaries = [s for s in report["results"] if s["draft_kind"] == kind]
        speed_ax, accept_ax = axes[0][column], axes[1][column]
        for s in summaries:
            label = s["method"] + ("" if s["method"] == "nospec" else f" k={s['k']}")
            cs = [int(c) for c in s["by_concurrency"]]
            speed_ax.plot(
                cs,
                [r["tokens_per_s_median"] for r in s["by_concurrency"].values()],
                "-o",
                label=label,
            )
            per_pos = s["by_concurrency"][str(max(cs))]["acceptance_per_pos"]
            if per_pos:
                accept_ax.plot(range(len(per_pos)), per_pos, "-o", label=label)
        speed_ax.set(title=f"{kind} drafts: tokens/s (median)", xlabel="concurrency")
        accept_ax.set(
            title=f"{kind} drafts: acceptance per position", xlabel="position", ylim=(-0.05, 1.05)
        )
        accept_ax.xaxis.get_major_locator().set_params(integer=True)
        speed_ax.legend()
        if accept_ax.lines:
            accept_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/side_by_side"))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument(
        "--drafts",
        default="oracle,random",
        help="oracle, random, trained (the output of train_tiny_drafter, see --trained-dir)",
    )
    parser.add_argument("--trained-dir", type=Path, default=Path("benchmarks/results/tiny"))
    parser.add_argument("--k", default="2,4", help="drafted tokens per step")
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--rounds", type=int, default=3, help="engine starts per setup")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per engine and C")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    args.methods = args.methods.split(",")
    args.drafts = args.drafts.split(",")
    if unknown := set(args.methods) - set(METHODS):
        parser.error(f"unknown --methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    if unknown := set(args.drafts) - set(DRAFT_KINDS):
        parser.error(f"unknown --drafts {sorted(unknown)}; choose from {', '.join(DRAFT_KINDS)}")
    try:
        args.k = [int(k) for k in args.k.split(",")]
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error("--k and --concurrency take comma-separated integers")
    if "trained" in args.drafts and not (args.trained_dir / "target" / "config.json").exists():
        parser.error(
            f"--drafts trained needs a trained draft in {args.trained_dir}: run "
            "`python -m benchmarks.train_tiny_drafter` first (or pass --trained-dir)"
        )
    if args.rounds < 1 or args.repeats < 1 or min(args.k) < 1 or min(args.concurrency) < 1:
        parser.error("--rounds, --k and --concurrency must be >= 1")
    if PROMPT_LEN + args.max_tokens + max(args.k) + 1 > 256:
        parser.error("--max-tokens too large for the 256-token context")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    print(format_report(report))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "side_by_side.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out / 'side_by_side.json'}")
    if plot(report, args.out / "side_by_side.png"):
        print(f"wrote {args.out / 'side_by_side.png'}")
    else:
        print("matplotlib is not installed: no plot written (pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
