# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""What a steady-state engine step reads from the device, DSpark against upstream DFlash.

    .venv/bin/python -m benchmarks.step_host_reads [--k 4] [--batch 4]

DSpark paged with confidence scheduling on (``threshold``) and off, and upstream DFlash, on the
tiny Qwen3 target with the same backbone weights, greedy. Every step of one generate call runs
under ``dspark_fixtures.host_syncs.step_reads`` (``execute_model``, ``sample_tokens`` and
``take_draft_token_ids``); for the steps in which every request verified drafts it prints the
device-to-host reads and syncing ops of the step with the most, and where they were called.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from dspark_fixtures.checkpoints.qwen3 import (
    DSparkDraftSpec,
    build_qwen3_target,
    random_dspark_weights,
    save_dflash_draft,
    save_dspark_draft,
)
from dspark_fixtures.engine import TinyEngine, dspark_config
from dspark_fixtures.host_syncs import StepReads, step_reads

PROMPT = list(range(5, 21))
CONFIDENCE = {"dspark_confidence_scheduler": "threshold", "dspark_confidence_threshold": 0.3}


def setups(root: Path, k: int) -> dict[str, tuple[Path, dict]]:
    """Proposer name: (target, speculative config)."""
    spec = DSparkDraftSpec(block_size=k, confidence_head=True, confidence_with_markov=True)
    weights = random_dspark_weights(spec)
    target = root / "target"
    build_qwen3_target(target, kind="random")
    dspark = save_dspark_draft(root / "dspark", spec, weights, target)
    backbone = {n: w for n, w in weights.items() if not n.startswith("confidence_head.")}
    dflash = save_dflash_draft(root / "dflash", spec, backbone)
    return {
        "dspark, confidence on": (target, dspark_config(dspark, k, **CONFIDENCE)),
        "dspark, confidence off": (target, dspark_config(dspark, k)),
        "dflash": (
            target,
            {"method": "dflash", "model": str(dflash), "num_speculative_tokens": k},
        ),
    }


def worst_decoding_step(target: Path, config: dict, batch: int) -> StepReads:
    with TinyEngine(target, config) as engine, step_reads(engine.model_runner) as steps:
        engine.generate([PROMPT] * batch, 24)
    decoding = [step for step in steps if step.decoding]
    assert decoding, "no step verified drafts for every request"
    return max(decoding, key=lambda step: len(step.reads) + len(step.syncs))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        for name, (target, config) in setups(Path(workdir), args.k).items():
            step = worst_decoding_step(target, config, args.batch)
            print(f"{name}: {len(step.reads)} device reads, {len(step.syncs)} syncing ops")
            for site in step.reads + step.syncs:
                print(f"  {site}")


if __name__ == "__main__":
    main()
