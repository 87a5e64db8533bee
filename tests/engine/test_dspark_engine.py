# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""DSpark on vLLM's V1 runner, end to end in the real CPU engine: what only the Qwen3 drafts
show (paged draft context). The tests both paged families run are in test_paged_families.py."""

import gc

import pytest
from test_paged_families import varied_prompts

from dspark_fixtures.checkpoints import qwen3
from dspark_fixtures.engine import (
    drafts_one_by_one,
    dspark_config,
    read_draft_log,
    run_engine,
)
from tests.helpers import ignored_errors

K = 4  # the tiny drafts' trained block size


@pytest.mark.parametrize("draft", ["bigram", "random"])
def test_the_context_reaches_the_drafts(tiny, tmp_path, draft):
    """The drafts the lossless and contamination tests compare depend on the
    context, not only on the anchor token: prompts that end alike but differ
    earlier get different drafts for the same anchor."""
    target = tiny.bigram_target if draft == "bigram" else tiny.random_target
    endings = " w40 w41 w42"
    prompts = [" ".join(f"w{100 + 7 * i + j}" for j in range(24)) + endings for i in range(4)]
    draft_dir, log = getattr(tiny, f"{draft}_draft"), tmp_path / "first.jsonl"
    by_prompt = drafts_one_by_one(target, draft_dir, prompts, [2] * 4, log, max_num_seqs=1)
    records = [by_anchor[min(by_anchor)] for by_anchor in by_prompt]
    anchors = {(r["anchor"], r["anchor_token"]) for r in records}
    if draft == "bigram":  # the bigram target's next token depends on the last token only
        assert len(anchors) == 1, anchors
    assert len({tuple(r["drafts"]) for r in records}) > 1, records


def test_temperature_sampling_returns_valid_tokens(tiny):
    run = run_engine(
        tiny.random_target,
        varied_prompts(4),
        24,
        dspark_config(tiny.random_draft),
        temperature=0.8,
        max_num_seqs=4,
    )
    assert [len(tokens) for tokens in run.token_ids] == [24] * 4
    assert all(0 <= t < 1000 for tokens in run.token_ids for t in tokens)
    assert run.drafts > 0


# --- k below the trained block size ---------------------------------------------


def test_k_below_the_block_drafts_the_full_block_and_verifies_its_start(tiny, tmp_path):
    """At k = 2 the drafts are the first two of the k = 4 block at the same
    anchor: the full trained block is drafted and truncated (DeepSpec's rule);
    a 2-query block would attend differently and change them."""
    prompts = varied_prompts(4, seed=3)
    logs = {}
    for k in (K, 2):
        logs[k] = tmp_path / f"k{k}.jsonl"
        run = run_engine(
            tiny.random_target,
            prompts,
            30,
            dspark_config(tiny.random_draft, k=k, dspark_draft_log=str(logs[k])),
            max_num_seqs=4,
        )
        assert len(run.accepted_per_position) == k
    full, short = read_draft_log(logs[K]), read_draft_log(logs[2])
    compared = 0
    for request, by_anchor in short.items():
        for anchor in by_anchor.keys() & full[request].keys():
            assert by_anchor[anchor]["drafts"] == full[request][anchor]["drafts"][:2]
            compared += 1
    assert compared >= 60


# --- Checkpoint layouts -----------------------------------------------------------


def test_dflash_layout_drafts_equal_deepspec_layout_drafts(tiny, tmp_path):
    """The same weights saved in the DFlash/speculators layout (``dflash_config``,
    no embedding or head in the file) draft exactly as DeepSpec's layout."""
    spec = qwen3.DSparkDraftSpec(layout="dflash")
    dflash_layout = qwen3.save_dspark_draft(tmp_path / "dflash-layout", spec)
    prompts = varied_prompts(3, seed=5)
    logs = {}
    for name, draft in (("deepspec", tiny.random_draft), ("dflash", dflash_layout)):
        logs[name] = tmp_path / f"{name}.jsonl"
        run_engine(
            tiny.random_target,
            prompts,
            20,
            dspark_config(draft, dspark_draft_log=str(logs[name])),
            max_num_seqs=3,
        )
    deepspec, dflash = (
        {
            request: {anchor: (r["anchor_token"], r["drafts"]) for anchor, r in records.items()}
            for request, records in read_draft_log(logs[name]).items()
        }
        for name in ("deepspec", "dflash")
    )
    assert sum(map(len, deepspec.values())) >= 40
    assert deepspec == dflash


def test_no_layer_is_left_for_a_late_garbage_collection(tiny, capfd, monkeypatch):
    """vLLM drops the draft's embed_tokens / lm_head when it shares the target's; held in
    reference cycles, they used to wait for a garbage collection that could come inside
    torch.compile's FakeTensor mode, where their oneDNN handles' ``__del__`` fails (two
    ``Exception ignored in: CPUDNNLGEMMHandler.__del__`` tracebacks in every compiled DSpark
    start). With automatic collection off, the proposer's load must leave no such handle for
    a later collection to free (read right after it returns)."""
    from vllm.v1.spec_decode.dspark.paged_proposer import DSparkPagedProposer

    left: list[object] = []
    load_model = DSparkPagedProposer.load_model

    def load_then_collect(self, target_model):
        load_model(self, target_model)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left.extend(o for o in gc.garbage if type(o).__name__ == "CPUDNNLGEMMHandler")
        gc.set_debug(0)
        gc.garbage.clear()

    monkeypatch.setattr(DSparkPagedProposer, "load_model", load_then_collect)
    gc.collect()
    gc.disable()
    try:
        run = run_engine(tiny.random_target, ["w1 w2 w3"], 2, dspark_config(tiny.random_draft))
    finally:
        gc.enable()
    assert len(run.token_ids[0]) == 2
    assert left == []
    captured = capfd.readouterr()
    assert ignored_errors(captured.out + captured.err) == []
