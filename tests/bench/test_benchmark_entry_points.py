# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Every benchmark the docs name starts: it imports and its ``--help`` prints usage.

The benchmarks run by hand, outside the test suite, so a module that no longer imports (a
helper it used was removed) would otherwise go unnoticed until someone reran it. The two
side-by-side benchmarks also run in a tiny fast mode on the real engine.
"""

import importlib
import json
import statistics
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted(
    path.stem
    for path in (Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py")
    if "def main(" in path.read_text()
)


def test_the_benchmarks_are_found():
    assert {"draft_sampling", "markov_topk", "cpu_side_by_side", "serve_summary"} <= set(BENCHMARKS)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_prints_its_usage(name, monkeypatch, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.engine
def test_side_by_side_fast_mode_times_interleaved_windows(tmp_path):
    """A tiny run of the side-by-side benchmark on the real engine: every engine
    gets one window per round, the oracle drafts are all accepted (tau = k + 1),
    speculation is lossless, and each ratio comes from the per-round speeds."""
    from benchmarks import cpu_side_by_side

    args = ["--drafts", "oracle", "--k", "2", "--concurrency", "1,2", "--rounds", "2"]
    args += ["--window", "0.05", "--max-tokens", "8", "--out", str(tmp_path)]
    assert cpu_side_by_side.main(args) == 0
    (kind,) = json.loads((tmp_path / "side_by_side.json").read_text())["kinds"]
    assert kind["unavailable"] == {}
    assert {(r["method"], r["k"]): r["tau"] for r in kind["results"]} == {
        ("nospec", 0): None,
        ("dflash", 2): 3.0,
        ("dspark", 2): 3.0,
    }
    speeds = {}
    for result in kind["results"]:
        for c, row in result["by_concurrency"].items():
            assert row.get("outputs_equal_nospec", True) is True
            speeds[result["method"], int(c)] = row["tokens_per_s"]["per_round"]
    assert all(len(per_round) == 2 for per_round in speeds.values())
    for row in kind["ratios"]:
        c = row["concurrency"]
        want = [a / b for a, b in zip(speeds["dspark", c], speeds["dflash", c], strict=True)]
        assert row["dspark_over_dflash"]["per_round"] == pytest.approx(want)
        assert row["dspark_over_dflash"]["median"] == pytest.approx(statistics.median(want))


@pytest.mark.engine
def test_gemma4_pair_runs_a_qwen3_dflash_draft(tmp_path):
    """The Gemma-4 row's DFlash draft (``save_gemma4_dflash_draft``, upstream's
    Qwen3 DFlash architecture over the Gemma-4 target's taps) runs in vLLM V1
    and, as an oracle, has every draft accepted, losslessly."""
    from benchmarks import cpu_side_by_side

    args = ["--drafts", "gemma4-oracle", "--methods", "nospec,dflash", "--k", "2"]
    args += ["--concurrency", "2", "--rounds", "1", "--window", "0.05", "--max-tokens", "8"]
    assert cpu_side_by_side.main([*args, "--out", str(tmp_path)]) == 0
    (kind,) = json.loads((tmp_path / "side_by_side.json").read_text())["kinds"]
    (dflash,) = [r for r in kind["results"] if r["method"] == "dflash"]
    assert dflash["tau"] == 3.0
    assert dflash["by_concurrency"]["2"]["outputs_equal_nospec"] is True


@pytest.mark.engine
def test_proposer_overhead_fast_mode_times_both_proposers(tmp_path):
    """A tiny run of the per-step benchmark: both proposers' steady-state steps
    are timed each round, the shared network is a part of each step, and the
    steps wait for the device nowhere."""
    from benchmarks import proposer_overhead

    args = proposer_overhead.parse_args(
        ["--batch-sizes", "2", "--k", "2", "--rounds", "2", "--max-tokens", "12"]
    )
    report = proposer_overhead.measure(args, tmp_path)
    for method in ("dflash", "dspark"):
        row = report["results"][method][2]
        assert row["steps"] >= 2 * 2  # a few steady steps in each of the two rounds
        assert 0 < row["outside_network_us"]["median"] < row["propose_us"]["median"]
        assert row["max_syncs_per_step"] == 0
    assert len(report["ratios"][2]["propose"]["per_round"]) == 2


@pytest.mark.engine
def test_draft_step_cost_counts_each_step_of_both_paged_proposers(tmp_path):
    """A tiny run of the counted-cost benchmark: a steady-state step of each paged proposer is
    counted, the graph and eager parts both hold ops, a step's launches do not depend on the
    batch size while its FLOPs grow with it, a padded batch adds the padding's eager ops, custom
    ops make fewer launches than ops, and the report and JSON give the DSpark / DFlash ratios."""
    from benchmarks import draft_step_cost as cost

    args = cost.parse_args(
        [
            "--k",
            "2",
            "--batch",
            "1",
            "4",
            "--padded",
            "3",
            "--families",
            "paged",
            "--draft-sample-method",
            "greedy",
            "--confidence",
            "off",
        ]
    )
    costs = cost.measure(args, tmp_path)
    proposers = (cost.DSPARK_PAGED, cost.DFLASH)
    assert set(costs) == {("greedy", m, 2, b) for m in proposers for b in (1, 3, 4)}
    for method in proposers:
        one, four = (costs["greedy", method, 2, b] for b in (1, 4))
        assert one.launches == four.launches
        assert min(one.ops.values()) > 0
        assert one.launches[cost.GRAPH] < one.ops[cost.GRAPH]
        assert 0 < one.total("flops") < four.total("flops")
    dspark = {b: costs["greedy", cost.DSPARK_PAGED, 2, b] for b in (3, 4)}
    assert dspark[3].ops[cost.EAGER] > dspark[4].ops[cost.EAGER]  # the padding rows
    comparisons = cost.compare(costs, args)
    assert "DSpark / baseline" in cost.format_report(costs, comparisons)
    ratios = cost.report_json(comparisons)["paged"]["2"]["greedy"]
    assert ratios["launch_ratio"] > 1 and set(ratios["modelled_ratio"]) == {
        device.name for device in cost.DEVICES
    }
    assert [c["padded_to"] for c in ratios["cells"]] == [1, 4, 4]
