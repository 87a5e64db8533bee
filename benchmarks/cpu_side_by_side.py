# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Side-by-side speed of no speculation, upstream DFlash and DSpark on the real vLLM
CPU engine, with tiny local models, built to resolve a few percent on a noisy box.

Every method sees the same prompts and the same greedy sampling. Draft kinds:
  * oracle: the target's lm_head is zero, so greedy decoding emits token 0 forever
    and every draft is accepted (DSpark's Markov projection is zeroed too, or it
    would break the tie): the DSpark/DFlash ratio then measures cost, not acceptance;
  * random: independent random draft weights, so drafts are (almost) never
    accepted -- the cost of speculating for nothing;
  * trained (opt-in): the drafts `train_tiny_drafter` wrote, on its target;
  * gemma4-oracle: the tiny Gemma-4 target with a zero final norm (greedy emits
    token 0) and a zero-final-norm DSpark draft; DFlash is a Qwen3-architecture
    DFlash draft (upstream's ``DFlashQwen3ForCausalLM``) over the same taps, since
    vLLM has no Gemma-4 DFlash class.
Protocol: all engines of a draft kind are built once and stay alive together. Each
round runs, for every concurrency C, one timing window per engine, the engines in
a rotated order; a window repeats ``generate`` calls of C prompts until
``--window`` seconds of generation have elapsed and counts their tokens. Ratios
are taken per round (engines a few seconds apart see the same load) and reported
as the median over rounds with the interquartile range and min-max beside it.

    python -m benchmarks.cpu_side_by_side                          # oracle and random
    python -m benchmarks.cpu_side_by_side --drafts oracle,gemma4-oracle --rounds 7
    python -m benchmarks.cpu_side_by_side --methods nospec,dflash --window 1

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

from dspark_fixtures.checkpoints.gemma4 import (
    Gemma4DraftSpec,
    build_gemma4_target,
    oracle_gemma4_draft_weights,
    save_gemma4_dflash_draft,
    save_gemma4_draft,
)
from dspark_fixtures.checkpoints.qwen3 import (
    VOCAB_SIZE,
    DSparkDraftSpec,
    build_qwen3_target,
    oracle_dspark_weights,
    random_dspark_weights,
    save_dflash_draft,
    save_dspark_draft,
)
from dspark_fixtures.engine import EngineUnavailable, TinyEngine
from dspark_fixtures.host_syncs import HostSyncRecorder

METHODS = ("nospec", "dflash", "dspark")
DRAFT_KINDS = ("oracle", "random", "trained", "gemma4-oracle")
PROMPT_LEN = 16
RATIOS = (("dspark", "dflash"), ("dspark", "nospec"), ("dflash", "nospec"))


@dataclass(frozen=True)
class Setup:
    """One engine configuration: a method and k (0 for nospec)."""

    method: str
    k: int

    @property
    def label(self) -> str:
        return self.method if self.method == "nospec" else f"{self.method} k={self.k}"


@dataclass
class Measured:
    """One engine's windows: tokens per wall and per CPU second, per concurrency
    and round; spec counters."""

    tokens_per_s: dict[int, list[float]] = field(default_factory=dict)
    tokens_per_cpu_s: dict[int, list[float]] = field(default_factory=dict)
    first_outputs: dict[int, list[list[int]]] = field(default_factory=dict)
    drafts: int = 0
    accepted: int = 0
    host_syncs_worst_step: list[str] = field(default_factory=list)

    @property
    def tau(self) -> float | None:
        """1 + accepted / drafts; vLLM's accepted count excludes the bonus token."""
        return 1 + self.accepted / self.drafts if self.drafts else None


def count_spec_stats(engine: TinyEngine, measured: Measured) -> None:
    """Sum this engine's per-step spec-decode stats as its scheduler makes them.

    Several engines live in this process, and each new one unregisters the
    previous ones' Prometheus collectors, so ``LLM.get_metrics`` would read the
    last engine's counters only; the scheduler's own stats are per engine."""
    scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
    make_stats = scheduler.make_stats

    def counting_make_stats(spec_decoding_stats=None, *args, **kwargs):
        if spec_decoding_stats is not None:
            measured.drafts += spec_decoding_stats.num_drafts
            measured.accepted += spec_decoding_stats.num_accepted_tokens
        return make_stats(spec_decoding_stats, *args, **kwargs)

    scheduler.make_stats = counting_make_stats


def trained_models(trained_dir: Path) -> dict[str, Path]:
    """The target and drafts written by `train_tiny_drafter --out trained_dir`."""
    models = {"target": trained_dir / "target"}
    for method in ("dspark", "dflash"):
        if (trained_dir / f"{method}_draft" / "model.safetensors").exists():
            models[method] = trained_dir / f"{method}_draft"
    return models


def build_models(kind: str, root: Path, trained_dir: Path) -> dict[str, Path]:
    """{"target", "dflash", "dspark"} for one draft kind; DFlash and DSpark share
    the backbone weights on the Qwen3 pairs (DFlash = DSpark minus the Markov head)."""
    if kind == "trained":
        return trained_models(trained_dir)
    root = root / kind
    target = root / "target"
    if kind == "gemma4-oracle":
        spec = Gemma4DraftSpec()
        if not (target / "config.json").exists():
            build_gemma4_target(target, kind="zero-norm")
        return {
            "target": target,
            "dspark": save_gemma4_draft(
                root / "dspark", spec, target, oracle_gemma4_draft_weights(spec)
            ),
            "dflash": save_gemma4_dflash_draft(root / "dflash", spec, oracle=True),
        }
    spec = DSparkDraftSpec()
    weights = oracle_dspark_weights(spec) if kind == "oracle" else random_dspark_weights(spec)
    if not (target / "config.json").exists():
        build_qwen3_target(target, kind="zero-lm-head" if kind == "oracle" else "random")
    return {
        "target": target,
        "dspark": save_dspark_draft(root / "dspark", spec, weights, target),
        "dflash": save_dflash_draft(root / "dflash", spec, weights),
    }


def fixed_prompts(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(5, VOCAB_SIZE, (count, PROMPT_LEN), generator=generator).tolist()


def timed_window(
    engine: TinyEngine, prompts: list[list[int]], max_tokens: int, seconds: float
) -> tuple[float, float, list[list[int]]]:
    """Tokens per wall second and per CPU second of this process over greedy
    ``generate`` calls repeated until ``seconds`` of generation elapsed, and the
    first call's outputs. The engine runs in this process and vLLM runs its
    torch ops on one thread while serving, so this process's CPU time is the
    work the calls cost, whatever share of the CPUs other jobs leave it.
    Calls ``LLM.generate`` directly: ``TinyEngine.generate`` also reads the
    metrics registry twice a call, which several live engines make stale (see
    ``count_spec_stats``)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    tokens, elapsed, cpu, first = 0, 0.0, 0.0, None
    while elapsed < seconds:
        started, cpu_started = time.perf_counter(), time.process_time()
        outputs = engine.llm.generate(inputs, params, use_tqdm=False)
        elapsed += time.perf_counter() - started
        cpu += time.process_time() - cpu_started
        token_ids = [list(o.outputs[0].token_ids) for o in outputs]
        tokens += sum(len(t) for t in token_ids)
        first = token_ids if first is None else first
    return tokens / elapsed, tokens / cpu, first


def host_syncs_per_step(engine: TinyEngine, prompts: list[list[int]]) -> list[str]:
    """The ops that would make the host wait for the GPU in the drafter's step,
    over the draft steps of one warm generate call (dspark_fixtures/host_syncs.py)."""
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


def spread(values: list[float]) -> dict:
    """Median, interquartile range and min-max of the per-round values."""
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {
        "median": statistics.median(values),
        "q1": q1,
        "q3": q3,
        "min": min(values),
        "max": max(values),
        "per_round": values,
    }


def start_engines(
    setups: list[Setup], models: dict[str, Path], max_num_seqs: int, unavailable: dict[str, str]
) -> dict[Setup, TinyEngine]:
    engines: dict[Setup, TinyEngine] = {}
    for setup in setups:
        if setup.method != "nospec" and setup.method not in models:
            unavailable[setup.method] = f"no {setup.method} draft for these models"
            continue
        if setup.method in unavailable:
            continue
        config = (
            None
            if setup.method == "nospec"
            else {
                "method": setup.method,
                "model": str(models[setup.method]),
                "num_speculative_tokens": setup.k,
            }
        )
        print(f"  starting {setup.label}", flush=True)
        try:
            engines[setup] = TinyEngine(models["target"], config, max_num_seqs=max_num_seqs)
        except EngineUnavailable as exc:
            unavailable[setup.method] = str(exc)
            print(f"  {setup.method} UNAVAILABLE in this vLLM: {exc}", flush=True)
    return engines


def run_kind(kind: str, args: argparse.Namespace) -> dict:
    """Every engine of one draft kind, alive together, timed round by round."""
    models = build_models(kind, args.out / "models", args.trained_dir)
    prompts = fixed_prompts(max(args.concurrency))
    setups = [
        Setup(method, 0 if method == "nospec" else k)
        for method in args.methods
        for k in ([0] if method == "nospec" else args.k)
    ]
    unavailable: dict[str, str] = {}
    print(f"{kind}: starting engines", flush=True)
    engines = start_engines(setups, models, max(args.concurrency), unavailable)
    measured = {setup: Measured() for setup in engines}
    try:
        for setup, engine in engines.items():
            for c in args.concurrency:
                engine.generate(prompts[:c], 8)  # warm-up at every C, not measured
            count_spec_stats(engine, measured[setup])
        order = list(engines)
        for round_index in range(args.rounds):
            print(f"{kind}: round {round_index + 1}/{args.rounds}", flush=True)
            shift = round_index % len(order)
            rotated = order[shift:] + order[:shift]
            for c in args.concurrency:
                for setup in rotated:
                    speed, cpu_speed, outputs = timed_window(
                        engines[setup], prompts[:c], args.max_tokens, args.window
                    )
                    measured[setup].tokens_per_s.setdefault(c, []).append(speed)
                    measured[setup].tokens_per_cpu_s.setdefault(c, []).append(cpu_speed)
                    measured[setup].first_outputs.setdefault(c, outputs)
        for setup, engine in engines.items():
            if setup.method != "nospec":
                measured[setup].host_syncs_worst_step = host_syncs_per_step(
                    engine, prompts[: max(args.concurrency)]
                )
    finally:
        for engine in engines.values():
            engine.close()
    return summarize(kind, measured, unavailable, args)


def summarize(
    kind: str, measured: dict[Setup, Measured], unavailable: dict[str, str], args
) -> dict:
    nospec = measured.get(Setup("nospec", 0))
    results = []
    for setup, m in measured.items():
        rows = {}
        for c, speeds in m.tokens_per_s.items():
            row = {
                "tokens_per_s": spread(speeds),
                "tokens_per_cpu_s": spread(m.tokens_per_cpu_s[c]),
            }
            if nospec is not None and setup.method != "nospec":
                row["outputs_equal_nospec"] = m.first_outputs[c] == nospec.first_outputs[c]
            rows[str(c)] = row
        results.append(
            {
                "method": setup.method,
                "k": setup.k,
                "tau": m.tau,
                "by_concurrency": rows,
                "host_syncs_worst_step": m.host_syncs_worst_step,
            }
        )
    ratios = []
    for k in args.k:
        for c in args.concurrency:
            row: dict = {"k": k, "concurrency": c}
            for top, bottom in RATIOS:
                a = measured.get(Setup(top, 0 if top == "nospec" else k))
                b = measured.get(Setup(bottom, 0 if bottom == "nospec" else k))
                for clock, series in (("", "tokens_per_s"), ("_cpu", "tokens_per_cpu_s")):
                    row[f"{top}_over_{bottom}{clock}"] = (
                        spread(
                            [
                                x / y
                                for x, y in zip(
                                    getattr(a, series)[c], getattr(b, series)[c], strict=True
                                )
                            ]
                        )
                        if a is not None and b is not None
                        else None
                    )
            ratios.append(row)
    return {"draft_kind": kind, "unavailable": unavailable, "results": results, "ratios": ratios}


def vllm_version() -> str:
    from vllm import __version__

    return __version__


def run(args: argparse.Namespace) -> dict:
    kinds = [run_kind(kind, args) for kind in args.drafts]
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
            "window_s": args.window,
            "max_tokens": args.max_tokens,
            "prompt_len": PROMPT_LEN,
            "timing": "tokens/s = generated tokens / generation time (wall, and CPU time of "
            "this process) of the generate calls of one window; ratios per round, then "
            "median [IQR] {min-max} over rounds",
        },
        "kinds": kinds,
    }


def _cell(stats: dict | None, unit: str = "x", digits: int = 2) -> str:
    if stats is None:
        return "n/a"
    f = f"{{:.{digits}f}}"
    return (
        f"{f.format(stats['median'])}{unit} [{f.format(stats['q1'])}-{f.format(stats['q3'])}]"
        f" {{{f.format(stats['min'])}-{f.format(stats['max'])}}}"
    )


def format_report(report: dict) -> str:
    lines = [
        "tok/s and ratios: median over rounds [interquartile range] {min-max}",
    ]
    for kind in report["kinds"]:
        name = kind["draft_kind"]
        for method, reason in kind["unavailable"].items():
            lines.append(f"{name} {method}: UNAVAILABLE ({reason}); no figures reported for it")
        lines.append(
            f"{'drafts':<14} {'method':<11} {'C':>2} {'tok/s':>28} {'tok/CPU-s':>28} {'tau':>5}"
            "  =nospec"
        )
        for r in kind["results"]:
            label = r["method"] + ("" if r["method"] == "nospec" else f" k={r['k']}")
            tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
            for c, row in r["by_concurrency"].items():
                equal = row.get("outputs_equal_nospec", "-")
                lines.append(
                    f"{name:<14} {label:<11} {c:>2} {_cell(row['tokens_per_s'], '', 0):>28} "
                    f"{_cell(row['tokens_per_cpu_s'], '', 0):>28} {tau:>5}  {equal}"
                )
        lines.append("host-sync ops in the worst draft step (would block on a GPU)")
        for r in kind["results"]:
            if r["method"] != "nospec":
                syncs = r["host_syncs_worst_step"]
                lines.append(f"{name:<14} {r['method']} k={r['k']}: {len(syncs)} {' '.join(syncs)}")
        for clock, title in (("", "by wall time"), ("_cpu", "by CPU time of this process")):
            lines.append(
                f"{'ratios ' + title:<20} {'k':>2} {'C':>2} "
                + " ".join(f"{f'{top}/{bottom}':>30}" for top, bottom in RATIOS)
            )
            for row in kind["ratios"]:
                cells = [_cell(row[f"{top}_over_{bottom}{clock}"]) for top, bottom in RATIOS]
                lines.append(
                    f"{name:<20} {row['k']:>2} {row['concurrency']:>2} "
                    + " ".join(f"{cell:>30}" for cell in cells)
                )
        lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/side_by_side"))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--drafts", default="oracle,random", help=", ".join(DRAFT_KINDS))
    parser.add_argument("--trained-dir", type=Path, default=Path("benchmarks/results/tiny"))
    parser.add_argument("--k", default="2,4", help="drafted tokens per step")
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--rounds", type=int, default=5, help="timing windows per engine and C")
    parser.add_argument("--window", type=float, default=3.0, help="seconds of generation a window")
    parser.add_argument("--max-tokens", type=int, default=64, help="per request and call")
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
    if args.rounds < 1 or args.window <= 0 or min(args.k) < 1 or min(args.concurrency) < 1:
        parser.error("--rounds, --window, --k and --concurrency must be positive")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
