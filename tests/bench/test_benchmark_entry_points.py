"""Every benchmark the docs name starts: it imports and its ``--help`` prints usage.

The benchmarks run by hand, outside the test suite, so a module that no longer imports (a
helper it used was removed) would otherwise go unnoticed until someone reran it.
"""

import importlib
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
