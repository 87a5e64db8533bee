"""The serving benchmark against real local vLLM servers, plus its metric arithmetic."""

from __future__ import annotations

import importlib.util
import json

import pytest

from benchmarks import serve_bench
from benchmarks.serve_bench import SpecCounters

# The exposition format of vLLM 0.32.0's /metrics (two data-parallel engines).
METRICS_TEXT = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 30.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.79e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 90.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 48.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 0.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 24.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="1"} 16.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="2"} 8.0
vllm:generation_tokens_total{engine="0",model_name="m"} 500.0
"""


def test_counters_sum_engines_and_tau_excludes_bonus():
    counters = SpecCounters.from_metrics(METRICS_TEXT)
    assert counters == SpecCounters(
        drafts=40.0, draft_tokens=120.0, accepted_tokens=60.0, accepted_per_pos=[32.0, 20.0, 8.0]
    )
    assert counters.tau == pytest.approx(1.0 + 60.0 / 40.0)
    assert counters.acceptance_per_pos == pytest.approx([0.8, 0.5, 0.2])
    assert counters.draft_acceptance_rate == pytest.approx(0.5)


def test_counter_delta_covers_only_the_window():
    before = SpecCounters(
        drafts=40.0, draft_tokens=120.0, accepted_tokens=60.0, accepted_per_pos=[32.0, 20.0, 8.0]
    )
    after = SpecCounters(
        drafts=50.0, draft_tokens=150.0, accepted_tokens=90.0, accepted_per_pos=[42.0, 30.0, 18.0]
    )
    delta = after - before
    assert delta.tau == pytest.approx(4.0)
    assert delta.acceptance_per_pos == pytest.approx([1.0, 1.0, 1.0])


def test_no_spec_metrics_means_no_tau():
    assert SpecCounters.from_metrics('vllm:generation_tokens_total{engine="0"} 5.0\n') is None
    assert SpecCounters(0.0, 0.0, 0.0, []).tau is None


def test_unreachable_server_is_a_clear_error(capsys, tmp_path, unused_url):
    code = serve_bench.main(["--url", unused_url, "--output", str(tmp_path / "out.json")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("serve_bench: error: cannot reach") and "Traceback" not in err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.engine
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_sweep_against_local_servers(tiny_servers, tmp_path, api, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w6 w7 w8\nw10 w11 w12\nw100 w200 w300 w400 w500\n")
    output, max_tokens, per_stream = tmp_path / "bench.json", 24, 2
    code = serve_bench.main(
        [
            "--url",
            tiny_servers["spec"].url,
            "--baseline-url",
            tiny_servers["plain"].url,
            "--api",
            api,
            "--concurrency",
            "1,4",
            "--requests-per-stream",
            str(per_stream),
            "--max-tokens",
            str(max_tokens),
            "--prompts",
            str(prompts),
            "--output",
            str(output),
            "--plot",
            str(tmp_path / "bench.png"),
        ]
    )
    assert code == 0
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (tmp_path / "bench.png").exists() == has_matplotlib
    if not has_matplotlib:
        assert "matplotlib is not installed" in capsys.readouterr().out
    report = json.loads(output.read_text())
    assert [level["concurrency"] for level in report["levels"]] == [1, 4]
    for level in report["levels"]:
        requests = level["concurrency"] * per_stream
        for name in ("spec", "baseline"):
            run = level[name]
            assert run["errors"] == []
            assert run["requests"] == requests
            assert run["completion_tokens"] == requests * max_tokens
            assert run["ttft_median_s"] > 0
            assert run["aggregate_tokens_per_s"] > 0
        # Draft = target: every one of the k = 3 drafts is accepted, plus the bonus.
        spec = level["spec"]
        assert spec["tau"] == pytest.approx(4.0, abs=0.01)
        assert spec["acceptance_per_pos"] == pytest.approx([1.0, 1.0, 1.0], abs=0.01)
        assert spec["spec_counters"]["drafts"] > 0
        # The plain server runs no speculation, so it has no acceptance to report.
        assert level["baseline"]["tau"] is None
        assert level["speedup_aggregate"] == pytest.approx(
            spec["aggregate_tokens_per_s"] / level["baseline"]["aggregate_tokens_per_s"]
        )


@pytest.mark.parametrize(
    ("chunk", "expected"),
    [
        ({"choices": [{"text": " w5", "token_ids": [9]}]}, (True, 1)),
        ({"choices": [{"delta": {"content": "hi"}}]}, (True, None)),
        ({"choices": [{"delta": {"reasoning_content": "think"}}]}, (True, None)),
        ({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, (False, None)),
        ({"choices": [], "usage": {"completion_tokens": 3}}, (False, None)),
    ],
)
def test_output_chunks_include_reasoning_deltas(chunk, expected):
    """Reasoning parsers (e.g. DeepSeek's) stream text outside `content`."""
    assert serve_bench.OpenAIEndpoint._chunk_output(chunk) == expected
