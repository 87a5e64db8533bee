# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""DeepSeek-V4 DSpark at tensor-parallel size 2, in two CPU worker processes.

The draft's layers shard over the target's tensor-parallel group and its loader cuts each rank's
share out of the ``mtp.*`` tensors. Every rank runs the draft, the ring and the confidence
scheduler; only rank 0's drafts and lengths reach the scheduler. Every rank writes
``dspark_draft_log`` (records carry the rank and the scheduled length), so the tests compare
rank 0 with rank 1 step by step, and TP = 2 with TP = 1 where the context is the same.

Workers are fresh interpreters, so the stand-ins this session installed are not in them: a
throw-away distribution on ``sys.path`` (spawned workers get the parent's) names
``dspark_fixtures.standins:install_standins`` as a ``vllm.general_plugins`` entry point,
which vLLM loads in every worker before it builds the model.
"""

from pathlib import Path

import pytest

from dspark_fixtures.checkpoints.deepseek_v4 import PERIOD, cycle_prompt
from dspark_fixtures.engine import draft_steps
from tests.engine_v4.v4_harness import dspark, run_v4

pytestmark = pytest.mark.multiproc

K = 4
PROMPTS = [cycle_prompt(10 + PERIOD * i, n) for i, n in enumerate([40, 45, 64, 50])]
MAX_TOKENS = [24, 40, 17, 33]


@pytest.fixture
def worker_standins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dist_info = tmp_path / "plugin" / "dspark_test_standins-0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: dspark-test-standins\nVersion: 0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\ndspark_test_standins = dspark_fixtures.standins:install_standins\n"
    )
    monkeypatch.syspath_prepend(str(dist_info.parent))


def run_both(target: Path, tmp_path: Path, **fields) -> tuple[dict, dict]:
    """Runs and draft logs at TP = 1 and TP = 2."""
    runs, logs = {}, {}
    for tp in (1, 2):
        logs[tp] = tmp_path / f"tp{tp}.jsonl"
        config = dspark(K, dspark_draft_log=str(logs[tp]), **fields)
        runs[tp] = run_v4(
            target, PROMPTS, MAX_TOKENS, config, max_num_seqs=4, tensor_parallel_size=tp
        )
    return runs, logs


def test_tp2_drafts_are_the_tp1_drafts(tiny_v4_models, worker_standins, tmp_path):
    """The oracle draft is right only with every rank's shard of every ``mtp.*`` tensor in its
    place: a wrong cut changes its drafts and they are no longer all accepted."""
    runs, logs = run_both(tiny_v4_models.oracle, tmp_path)

    assert runs[2].token_ids == runs[1].token_ids
    drafted = runs[2].metrics["vllm:spec_decode_num_draft_tokens"]
    assert drafted >= 40
    assert runs[2].metrics["vllm:spec_decode_num_accepted_tokens"] == drafted
    rank0 = draft_steps(logs[2], rank=0)
    assert draft_steps(logs[2], rank=1) == rank0
    assert draft_steps(logs[1]) == rank0


def test_tp2_ranks_schedule_the_same_lengths(tiny_v4_models, worker_standins, tmp_path):
    """With the checkpoint's random confidence head the lengths vary with the context; both
    ranks must pick the same ones from the same drafts."""
    _, logs = run_both(
        tiny_v4_models.noisy,
        tmp_path,
        dspark_confidence_scheduler="threshold",
        dspark_confidence_threshold=0.5,
    )

    rank0 = draft_steps(logs[2], rank=0)
    assert draft_steps(logs[2], rank=1) == rank0
    lengths = [r["verify"] for records in rank0.values() for r in records.values()]
    assert len(set(lengths)) >= 3, f"the confidence head should vary the lengths: {set(lengths)}"
