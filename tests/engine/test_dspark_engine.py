"""DSpark on vLLM's V1 runner, end to end in the real CPU engine (Qwen3 drafts,
paged draft context)."""

import dataclasses
import random
from pathlib import Path

import pytest

from dspark_demo.checkpoints import qwen3
from dspark_demo.engine import (
    TinyEngine,
    drafts_one_by_one,
    dspark_config,
    read_draft_log,
    run_engine,
)

pytestmark = pytest.mark.engine

K = 4  # the tiny drafts' trained block size


def varied_prompts(count: int, seed: int = 0) -> list[str]:
    """Prompts from 3 to ~90 words; two share a 64-word prefix so that the
    second one starts from a prefix-cache hit."""
    rng = random.Random(seed)
    lengths = [3, 9, 17, 30, 45, 60, 5, 24, 70, 12, 38, 52][:count]
    prompts = [" ".join(f"w{rng.randrange(990)}" for _ in range(n)) for n in lengths]
    shared = " ".join(f"w{rng.randrange(990)}" for _ in range(64))
    return [*prompts[:-2], f"{shared} w1 w2 w3", f"{shared} w7 w8 w9 w10 w11"]


# Four sequences at a time, 48-token steps (prefills are chunked and mixed with
# decodes) and prefix caching on.
CHURN = dict(max_num_seqs=4, max_num_batched_tokens=48, enable_prefix_caching=True)
LOSSLESS_PROMPTS = varied_prompts(10)
LOSSLESS_MAX_TOKENS = [40, 25, 60, 33, 20, 50, 45, 30, 22, 55]


@pytest.fixture(scope="module")
def plain_bigram(tiny):
    return run_engine(tiny.bigram_target, LOSSLESS_PROMPTS, LOSSLESS_MAX_TOKENS, **CHURN)


@pytest.mark.parametrize("k", [K, 2], ids=["k=block", "k<block"])
def test_greedy_output_is_lossless_with_partial_acceptance(tiny, plain_bigram, k):
    dspark = run_engine(
        tiny.bigram_target,
        LOSSLESS_PROMPTS,
        LOSSLESS_MAX_TOKENS,
        dspark_config(tiny.bigram_draft, k=k),
        **CHURN,
    )
    assert dspark.token_ids == plain_bigram.token_ids
    # The comparison means something only if drafts were both accepted and
    # rejected, at every position, and the prefix cache and chunking were hit.
    accepted = dspark.accepted_per_position
    assert len(accepted) == k
    assert all(0 < n < dspark.drafts for n in accepted), accepted
    assert dspark.metrics["vllm:prefix_cache_hits"] > 0
    assert len({tuple(t) for t in plain_bigram.token_ids}) == len(LOSSLESS_PROMPTS)


def only_request(log: Path) -> dict:
    """The draft-log records of a log holding one request's drafts, by anchor,
    without the request id (which differs between engines)."""
    (records,) = read_draft_log(log).values()
    return {
        anchor: {key: value for key, value in record.items() if key != "req_id"}
        for anchor, record in records.items()
    }


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


@pytest.mark.parametrize("k", [K, 2])
def test_oracle_draft_is_always_accepted(tiny, k):
    run = run_engine(
        tiny.zero_target,
        varied_prompts(4),
        32,
        dspark_config(tiny.oracle_draft, k=k),
        max_num_seqs=4,
    )
    assert run.drafts > 0
    assert run.accepted_per_position == [run.drafts] * k
    assert all(set(tokens) == {0} for tokens in run.token_ids)


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


# --- Prefix caching keeps the draft's context -----------------------------------

# 190 shared words: five full 32-token KV blocks and a partial one (vLLM 0.32.0
# drops the last cached block for EAGLE-family drafters, so four are hit).
SHARED_PREFIX = " ".join(f"w{(37 * i) % 990 + 5}" for i in range(190))
TURNS = [f"{SHARED_PREFIX} w11 w12 w13", f"{SHARED_PREFIX} w21 w22 w23 w24 w25"]


def second_turn_drafts(tiny, tmp_path: Path, name: str, caching: bool, between=None):
    """Drafts of the second prompt, run after the first in the same engine."""
    log = tmp_path / f"{name}.jsonl"
    with TinyEngine(
        tiny.random_target,
        dspark_config(tiny.random_draft, dspark_draft_log=str(log)),
        max_num_seqs=2,
        enable_prefix_caching=caching,
    ) as engine:
        engine.generate(TURNS[:1], 20)
        if between is not None:
            between(engine)
        log.unlink()
        second = engine.generate(TURNS[1:], 30)
    return only_request(log), second


@pytest.fixture(scope="module")
def without_cache(tiny, tmp_path_factory):
    return second_turn_drafts(tiny, tmp_path_factory.mktemp("nocache"), "uncached", caching=False)


def test_drafts_after_a_prefix_cache_hit_equal_drafts_without_the_cache(
    tiny, tmp_path, without_cache
):
    cached, hit = second_turn_drafts(tiny, tmp_path, "cached", caching=True)
    uncached, miss = without_cache
    assert hit.metrics["vllm:prefix_cache_hits"] >= 128  # four blocks of the prefix
    assert miss.metrics.get("vllm:prefix_cache_hits", 0) == 0
    assert hit.token_ids == miss.token_ids
    assert len(cached) >= 25
    assert cached == uncached


def draft_kv_caches(engine: TinyEngine) -> list:
    drafter = engine.model_runner.drafter
    contexts = engine.model_runner.compilation_config.static_forward_context
    return [contexts[name].kv_cache for name in sorted(drafter._draft_attn_layer_names)]


def test_prefix_cache_check_fails_when_cached_draft_context_is_lost(tiny, tmp_path, without_cache):
    """The check above has teeth: wiping the draft layers' cached K/V between
    the turns (what a draft context outside the paged cache amounts to after a
    hit) changes the second turn's drafts."""

    def wipe(engine: TinyEngine) -> None:
        for cache in draft_kv_caches(engine):
            (cache[0] if isinstance(cache, list) else cache).zero_()

    cached, hit = second_turn_drafts(tiny, tmp_path, "wiped", caching=True, between=wipe)
    assert hit.metrics["vllm:prefix_cache_hits"] >= 128
    assert cached != without_cache[0]


# --- No cross-request contamination ---------------------------------------------

CONTAMINATION_PROMPTS = varied_prompts(8, seed=1)
# Request 5 finishes early, so V1 condenses still-running requests into its row.
CONTAMINATION_MAX_TOKENS = [40, 25, 60, 33, 20, 8, 45, 70]
# 10 KV blocks of 32 tokens cannot hold four growing sequences: the scheduler
# preempts and later resumes requests, on top of staggered finishes.
CROWDED = dict(max_num_seqs=4, max_num_batched_tokens=48, num_gpu_blocks_override=10)
ALONE = dict(max_num_seqs=4)


def crowded_drafts(tiny, tmp_path: Path) -> dict:
    crowded_log = tmp_path / "crowded.jsonl"
    crowded = run_engine(
        tiny.random_target,
        CONTAMINATION_PROMPTS,
        CONTAMINATION_MAX_TOKENS,
        dspark_config(tiny.random_draft, dspark_draft_log=str(crowded_log)),
        **CROWDED,
    )
    assert crowded.metrics["vllm:num_preemptions"] > 0, "the crowded run must preempt"
    return read_draft_log(crowded_log, first=True)


@pytest.fixture(scope="module")
def alone(tiny, tmp_path_factory) -> dict:
    """Each request's drafts served on its own; shared by the check and its control (whose
    fault needs two requests in a batch, so it cannot act here)."""
    log = tmp_path_factory.mktemp("alone") / "alone.jsonl"
    by_prompt = drafts_one_by_one(
        tiny.random_target,
        tiny.random_draft,
        CONTAMINATION_PROMPTS,
        CONTAMINATION_MAX_TOKENS,
        log,
        **ALONE,
    )
    return {str(index): records for index, records in enumerate(by_prompt)}


def mismatched_requests(alone, crowded) -> list[str]:
    """Requests whose drafts differ at an anchor both runs drafted from."""
    return [
        request
        for request, by_anchor in alone.items()
        if any(
            by_anchor[anchor]["drafts"] != crowded[request][anchor]["drafts"]
            for anchor in by_anchor.keys() & crowded[request].keys()
        )
    ]


def test_drafts_are_the_same_alone_and_among_churning_requests(tiny, tmp_path, alone):
    crowded = crowded_drafts(tiny, tmp_path)
    for request, by_anchor in alone.items():
        # Random drafts are rejected, so decode steps happen at the same anchors
        # in both runs: nearly every anchor must be comparable.
        common = by_anchor.keys() & crowded[request].keys()
        assert len(common) >= len(by_anchor) - 1, (request, len(common), len(by_anchor))
    assert mismatched_requests(alone, crowded) == []


def test_contamination_check_fails_with_swapped_draft_block_tables(
    tiny, tmp_path, monkeypatch, alone
):
    """The check above has teeth: when the draft reads and writes its context
    through two requests' swapped block-table rows, their drafts change."""
    from vllm.v1.spec_decode.dspark.paged_proposer import DSparkPagedProposer

    set_inputs = DSparkPagedProposer.set_inputs_first_pass

    def swapped_rows(self, *args, cad, **kwargs):
        if cad.batch_size() >= 2:
            table = cad.block_table_tensor.clone()
            table[[0, 1]] = table[[1, 0]]
            cad = dataclasses.replace(cad, block_table_tensor=table)
        return set_inputs(self, *args, cad=cad, **kwargs)

    monkeypatch.setattr(DSparkPagedProposer, "set_inputs_first_pass", swapped_rows)
    assert len(mismatched_requests(alone, crowded_drafts(tiny, tmp_path))) >= 2


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
