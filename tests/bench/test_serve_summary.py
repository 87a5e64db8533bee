# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""`vllm bench serve` against real local vLLM servers, summarised by benchmarks/serve_summary.py;
the summariser's pairing and refusals on small result files."""

import json
from pathlib import Path

import pytest

from benchmarks import serve_summary
from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

LEVELS = (1, 4)
OUTPUT_LEN = 24


def bench_serve(argv: list[str]) -> None:
    """`vllm bench serve ARGV`: the CLI's own subcommand (its parser and its `cmd`), run in this
    process, so that each run does not pay a fresh interpreter and vLLM import."""
    parser = FlexibleArgumentParser()
    BenchmarkServingSubcommand.add_cli_args(parser)
    BenchmarkServingSubcommand.cmd(parser.parse_args(argv))


@pytest.fixture(scope="module")
def bench_results(tiny_servers, tmp_path_factory) -> Path:
    """`vllm bench serve --save-result` at each level, the servers alternating level by level,
    as docs/benchmarks.md runs it."""
    root = tmp_path_factory.mktemp("bench-results")
    for concurrency in LEVELS:
        for name, server in tiny_servers.items():
            bench_serve([
                "--base-url", server.url,
                "--dataset-name", "random", "--random-input-len", "8",
                "--random-output-len", str(OUTPUT_LEN), "--ignore-eos", "--temperature", "0",
                "--num-prompts", str(2 * concurrency), "--max-concurrency", str(concurrency),
                "--num-warmups", "1", "--seed", "0", "--disable-tqdm",
                "--save-result", "--result-dir", str(root / name),
                "--result-filename", f"c{concurrency}.json",
            ])  # fmt: skip
    return root


@pytest.mark.multiproc
def test_summary_of_real_vllm_bench_serve_runs(bench_results, capsys):
    spec_dir, plain_dir = bench_results / "spec", bench_results / "plain"
    assert serve_summary.main([str(spec_dir), str(plain_dir)]) == 0
    table = capsys.readouterr().out
    rows = serve_summary.compare(
        serve_summary.load_runs(spec_dir), serve_summary.load_runs(plain_dir)
    )
    assert [row["concurrency"] for row in rows] == list(LEVELS)
    for row in rows:
        spec, plain = row["dspark"], row["plain"]
        for run in (spec, plain):
            assert run["completed"] == 2 * row["concurrency"] and run["failed"] == 0
            assert run["total_output_tokens"] == run["completed"] * OUTPUT_LEN
        # Draft = target, k = 3: every draft is accepted, plus the bonus token. vllm bench serve
        # read these from the server's /metrics around the run.
        assert row["tau"] == pytest.approx(4.0)
        assert row["acceptance_per_pos"] == pytest.approx([1.0, 1.0, 1.0])
        assert "spec_decode_num_drafts" not in plain
        # vLLM's client sums counters by substring (num_draft_tokens, num_drafts, ...): the
        # patch's per-position counter must match none of them, or draft tokens come out doubled.
        assert spec["spec_decode_draft_tokens"] == 3 * spec["spec_decode_num_drafts"]
        assert spec["spec_decode_acceptance_rate"] == pytest.approx(100.0)
        assert row["throughput_speedup"] == spec["output_throughput"] / plain["output_throughput"]
        assert row["tpot_speedup"] == plain["median_tpot_ms"] / spec["median_tpot_ms"]
        assert f"{row['throughput_speedup']:>8.2f}x" in table
    assert table.count("  4.00  1.00 1.00 1.00") == len(LEVELS)


# --- pairing and refusals, on result files holding the fields the summariser reads ---------------


def write_run(directory: Path, concurrency: int | None, spec: bool = True, **fields) -> Path:
    run = {
        "max_concurrency": concurrency,
        "num_prompts": 8,
        "total_output_tokens": 2048,
        "completed": 8,
        "failed": 0,
        "output_throughput": 300.0 if spec else 200.0,
        "median_tpot_ms": 10.0 if spec else 15.0,
        "median_ttft_ms": 40.0,
    }
    if spec:
        run |= {
            "spec_decode_num_drafts": 100,
            "spec_decode_acceptance_length": 2.5,
            "spec_decode_per_position_acceptance_rates": [0.9, 0.6],
        }
    directory.mkdir(exist_ok=True)
    path = directory / f"c{concurrency}.json"
    path.write_text(json.dumps(run | fields))
    return path


def summarise(tmp_path: Path, capsys) -> tuple[int, str, str]:
    code = serve_summary.main([str(tmp_path / "dspark"), str(tmp_path / "plain")])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_levels_are_paired_and_the_speedups_printed(tmp_path, capsys):
    for concurrency in (8, 1):
        write_run(tmp_path / "dspark", concurrency)
        write_run(tmp_path / "plain", concurrency, spec=False)
    code, out, _ = summarise(tmp_path, capsys)
    assert code == 0
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[1::3]] == ["1", "8"]
    assert lines[1].split() == ["1", "dspark", "300.0", "10.00", "40.0", "2.50", "0.90", "0.60"]
    assert lines[2].split() == ["plain", "200.0", "15.00", "40.0"]
    assert lines[3].split() == ["speed-up", "1.50x", "1.50x"]


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d, p: (write_run(d, 1), write_run(d, 4), write_run(p, 1, spec=False)),
         "concurrency levels 4 have no matched run"),
        (lambda d, p: (write_run(d, 1), write_run(p, 1)),
         "the no-speculation server drafted tokens"),
        (lambda d, p: (write_run(d, 1, spec=False), write_run(p, 1, spec=False)),
         "no spec-decode counters; not a DSpark server?"),
        (lambda d, p: (write_run(d, 1), write_run(p, 1, spec=False, total_output_tokens=2000)),
         "total_output_tokens 2048 vs 2000; run both with the same prompts and --ignore-eos"),
        (lambda d, p: write_run(p, 1, spec=False), "dspark: no vllm bench serve result"),
        (lambda d, p: (write_run(d, 1), (d / "x.json").write_text("{}"), write_run(p, 1)),
         "x.json: not a vllm bench serve --save-result file"),
    ],
    ids=["unmatched", "plain-drafted", "no-counters", "unequal-work", "missing", "not-a-result"],
)  # fmt: skip
def test_runs_that_do_not_match_are_refused_in_one_line(tmp_path, capsys, setup, message):
    (tmp_path / "dspark").mkdir()
    (tmp_path / "plain").mkdir()
    setup(tmp_path / "dspark", tmp_path / "plain")
    code, out, err = summarise(tmp_path, capsys)
    assert (code, out) == (2, "")
    assert err.startswith("serve_summary: error: ") and message in err
    assert err.count("\n") == 1


def test_failed_requests_are_reported(tmp_path, capsys):
    write_run(tmp_path / "dspark", 1, failed=2)
    write_run(tmp_path / "plain", 1, spec=False, output_throughput=0.0)
    code, out, _ = summarise(tmp_path, capsys)
    assert code == 1
    assert out.splitlines()[3].split() == ["speed-up", "-", "1.50x"]
    assert "2 request(s) failed" in out
