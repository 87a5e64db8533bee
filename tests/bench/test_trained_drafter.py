# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""A briefly trained draft is accepted as often inside vLLM as the plain-torch replay
predicts. A wrong position offset, feature tap or context mask on either side makes
the two disagree (or the engine's acceptance collapse), which random drafts,
accepted never, cannot show."""

from __future__ import annotations

import json

import pytest

from benchmarks import train_tiny_drafter


@pytest.mark.engine
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_engine_acceptance_matches_torch_replay(tmp_path, method):
    code = train_tiny_drafter.main(
        [
            "--out", str(tmp_path),
            "--method", method,
            "--steps", "200",
            "--train-seqs", "256",
            "--eval-seqs", "16",
            "--log-every", "100",
            "--random-init",  # so that acceptance comes from training alone
            "--engine",
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / f"{method}_report.json").read_text())
    engine = report["engine_eval"]
    if not engine["available"]:
        pytest.skip(f"vLLM cannot run {method}: {engine['reason']}")
    torch_eval = report["torch_eval"]
    assert torch_eval["tau"] > 1.1, "the short training should already be accepted sometimes"
    assert report["untrained"]["tau"] < 1.05
    assert engine["outputs_equal_torch_greedy"] == "16/16"
    assert engine["tau"] == pytest.approx(torch_eval["tau"], abs=0.1)
    assert engine["acceptance_per_pos"][0] == pytest.approx(
        torch_eval["acceptance_per_pos"][0], abs=0.05
    )
