# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""DSpark against a matched no-speculation server, side by side from `vllm bench serve` results.

    python benchmarks/serve_summary.py results/dspark results/plain

Each argument is a `vllm bench serve --save-result` JSON file or a directory of them (one run per
`--max-concurrency`; docs/benchmarks.md section 1 has the commands). Runs are paired by
concurrency; per level it prints output tokens/s, median TPOT and median TTFT of both servers, the
speed-ups (DSpark / plain for tokens/s, plain / DSpark for TPOT: above 1 means DSpark is faster)
and DSpark's acceptance, which `vllm bench serve` reads from the server's `/metrics` before and
after each run: acceptance length tau = 1 + accepted / drafts (vLLM's accepted counter excludes the
bonus token) and the share of drafts accepted up to each position. Standard library only.

Exit codes: 0 all requests succeeded; 1 some failed; 2 the files are missing, unmatched, or
not the runs they should be (printed in one line).
"""

import argparse
import json
import sys
from pathlib import Path


class SummaryError(ValueError):
    """A problem with the input files; printed without a traceback."""


def load_runs(path: Path) -> dict[int | None, dict]:
    """The runs in `path` (a JSON file or a directory of them), by `max_concurrency`."""
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise SummaryError(f"{path}: no vllm bench serve result (*.json) there")
    runs: dict[int | None, dict] = {}
    for file in files:
        try:
            run = json.loads(file.read_text())
        except (OSError, ValueError) as error:
            raise SummaryError(f"{file}: not a readable JSON file ({error})") from None
        if not isinstance(run, dict) or "output_throughput" not in run:
            raise SummaryError(f"{file}: not a vllm bench serve --save-result file")
        concurrency = run.get("max_concurrency")
        if concurrency in runs:
            raise SummaryError(f"{path}: two runs at max_concurrency {concurrency}")
        runs[concurrency] = {**run, "file": str(file)}
    return runs


def compare(dspark: dict[int | None, dict], plain: dict[int | None, dict]) -> list[dict]:
    """One row per concurrency: both runs' figures, the speed-ups, DSpark's acceptance."""
    if dspark.keys() != plain.keys():
        unmatched = sorted(map(str, dspark.keys() ^ plain.keys()))
        raise SummaryError(f"concurrency levels {', '.join(unmatched)} have no matched run")
    rows = []
    for concurrency in sorted(dspark, key=lambda c: (c is None, c)):
        spec, base = dspark[concurrency], plain[concurrency]
        if "spec_decode_num_drafts" not in spec:
            raise SummaryError(f"{spec['file']}: no spec-decode counters; not a DSpark server?")
        if base.get("spec_decode_num_drafts"):
            raise SummaryError(f"{base['file']}: the no-speculation server drafted tokens")
        for key in ("num_prompts", "total_output_tokens"):
            if spec.get(key) != base.get(key):
                raise SummaryError(
                    f"concurrency {concurrency}: {key} {spec.get(key)} vs {base.get(key)}; "
                    "run both with the same prompts and --ignore-eos"
                )
        rows.append(
            {
                "concurrency": concurrency,
                "dspark": spec,
                "plain": base,
                "throughput_speedup": _ratio(spec["output_throughput"], base["output_throughput"]),
                "tpot_speedup": _ratio(base["median_tpot_ms"], spec["median_tpot_ms"]),
                "tau": spec["spec_decode_acceptance_length"],
                "acceptance_per_pos": spec["spec_decode_per_position_acceptance_rates"],
                "failed": spec["failed"] + base["failed"],
            }
        )
    return rows


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None  # None: no request succeeded


def _speedup(ratio: float | None) -> str:
    return f"{'-':>9}" if ratio is None else f"{ratio:>8.2f}x"


def format_table(rows: list[dict]) -> str:
    lines = [
        f"{'C':>4} {'server':<8}{'tok/s':>9}{'TPOT ms':>9}{'TTFT ms':>9}{'tau':>6}  "
        "acceptance per position"
    ]
    for row in rows:
        level = "-" if row["concurrency"] is None else row["concurrency"]
        for name in ("dspark", "plain"):
            run = row[name]
            acceptance = ""
            if name == "dspark":
                per_pos = " ".join(f"{a:.2f}" for a in row["acceptance_per_pos"])
                acceptance = f"{row['tau']:>6.2f}  {per_pos}"
            lines.append(
                f"{level:>4} {name:<8}{run['output_throughput']:>9.1f}"
                f"{run['median_tpot_ms']:>9.2f}{run['median_ttft_ms']:>9.1f}{acceptance}"
            )
            level = ""
        speedups = _speedup(row["throughput_speedup"]) + _speedup(row["tpot_speedup"])
        lines.append(f"{'':>4} {'speed-up':<8}{speedups}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dspark", type=Path, help="result file or directory of the DSpark server")
    parser.add_argument("plain", type=Path, help="the same of the matched plain server")
    args = parser.parse_args(argv)
    try:
        rows = compare(load_runs(args.dspark), load_runs(args.plain))
    except SummaryError as error:
        print(f"serve_summary: error: {error}", file=sys.stderr)
        return 2
    print(format_table(rows))
    failed = sum(row["failed"] for row in rows)
    if failed:
        print(f"serve_summary: {failed} request(s) failed; see 'errors' in the JSON files")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
