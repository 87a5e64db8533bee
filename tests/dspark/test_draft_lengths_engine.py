"""Shorter draft lists shrink the target's verify batch in vLLM's V1 engine (sync scheduling).

A custom proposer returns a different number of drafts per request. The test checks, on a real
CPU engine, that the scheduler schedules exactly `1 + len(drafts)` rows per decoding request, that
the target model's forward runs on exactly that many rows, and that greedy output is unchanged.
This is the path that confidence scheduling relies on; CPU vLLM always schedules synchronously.
"""

import gc
import json

import pytest
import torch

pytestmark = pytest.mark.engine

K = 4
VOCAB = 1000


class LastTokenProposer:
    """Drafts the last sampled token; proposes `last % (K + 1)` drafts, so lengths vary 0..K."""

    def __init__(self, vllm_config) -> None:
        assert vllm_config.speculative_config.num_speculative_tokens == K

    def load_model(self, target_model) -> None:
        """Nothing to load; vLLM's CPU runner calls this for every drafter."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        return [[ids[-1]] * (ids[-1] % (K + 1)) if ids else [] for ids in sampled_token_ids]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen3")
    words = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(VOCAB - 4)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    ).save_pretrained(path)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return str(path)


def run_engine(model: str, monkeypatch, speculative_config: dict | None):
    from vllm import LLM, SamplingParams

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=8,
        seed=0,
        enforce_eager=True,
        disable_log_stats=False,
        speculative_config=speculative_config,
    )
    steps: list[tuple[dict[str, int], dict[str, list[int]]]] = []
    forward_rows: list[int] = []
    if speculative_config is not None:
        core = llm.llm_engine.engine_core.engine_core
        schedule = core.scheduler.schedule

        def recording_schedule(*args, **kwargs):
            output = schedule(*args, **kwargs)
            steps.append(
                (
                    dict(output.num_scheduled_tokens),
                    {r: list(t) for r, t in output.scheduled_spec_decode_tokens.items()},
                )
            )
            return output

        core.scheduler.schedule = recording_schedule
        model_runner = core.model_executor.driver_worker.worker.model_runner
        model_runner.model.register_forward_pre_hook(
            lambda module, args, kwargs: forward_rows.append(kwargs["input_ids"].shape[0]),
            with_kwargs=True,
        )
    prompts = [" ".join(f"w{(7 * p + 3 * i) % 50 + 5}" for i in range(6 + p)) for p in range(4)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    texts = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    metrics = {m.name: m for m in llm.get_metrics()}
    del llm
    gc.collect()
    return texts, steps, forward_rows, metrics


def test_shorter_draft_lists_shrink_the_verify_batch(tiny_qwen3, monkeypatch):
    plain, _, _, _ = run_engine(tiny_qwen3, monkeypatch, None)
    speculative_config = {
        "method": "custom_class",
        "model": f"{__name__}.LastTokenProposer",
        "num_speculative_tokens": K,
    }
    outputs, steps, forward_rows, metrics = run_engine(
        tiny_qwen3, monkeypatch, json.loads(json.dumps(speculative_config))
    )
    assert outputs == plain  # Verification stays exact whatever the lengths.

    decode_steps = [(tokens, spec) for tokens, spec in steps if spec]
    lengths = [len(ids) for _, spec in decode_steps for ids in spec.values()]
    assert set(lengths) > {1, K}, lengths  # The lengths really vary across requests and steps.
    for tokens, spec in decode_steps:
        for req_id, ids in spec.items():
            assert tokens[req_id] == 1 + len(ids)  # One bonus row plus one row per draft.
    # The target's forward ran on exactly the scheduled rows, far fewer than 1 + K per request.
    assert forward_rows == [sum(tokens.values()) for tokens, _ in steps if tokens]
    shrunk_rows = sum(sum(tokens.values()) for tokens, _ in decode_steps)
    full_rows = sum(sum(1 + K for _ in tokens) for tokens, _ in decode_steps)
    assert shrunk_rows < full_rows
    # vLLM's own spec-decode counters see the scheduled lengths.
    assert metrics["vllm:spec_decode_num_draft_tokens"].value == sum(lengths)
    print(f"verify rows: {shrunk_rows} scheduled vs {full_rows} at full k={K}")
