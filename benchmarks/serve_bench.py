"""Serving benchmark for any OpenAI-compatible vLLM server.

Sweeps client concurrency, streams completions to time each request, and reads the
server's Prometheus spec-decode counters before and after every level, so each
level reports its own acceptance length tau = 1 + accepted / drafts (vLLM's
accepted-token counter excludes the bonus token). Given a second endpoint that
serves the same model without speculation, it runs the same levels there,
alternating endpoint by endpoint, and prints the speed-up ratio per level.

Standard library only; plotting uses matplotlib when it is installed.

Timing convention (client side, per request):
  * TTFT: request sent -> first streamed chunk that carries output;
  * per-stream decode tok/s: tokens after the first output chunk / (last output chunk -
    first output chunk), i.e. decode after the first token (vLLM returns token ids per
    chunk; other servers are assumed to put one token in the first chunk);
  * aggregate tok/s: all completion tokens of the level / level wall time (first
    request sent -> last request finished), prefill and queueing included.

Run it with nothing else talking to the server: the counters are server-wide.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_PROMPTS = [
    "Explain, step by step, how a hash map handles collisions.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Summarize the causes of the French Revolution in a short paragraph.",
    "List five practical tips for writing clear technical documentation.",
    "Describe how TCP congestion control reacts to packet loss.",
    "Translate to French: The meeting is moved to Thursday afternoon.",
    "What is the difference between a process and a thread?",
    "Write a SQL query that returns the ten most recent orders per customer.",
]

SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
SPEC_PER_POS_COUNTER = "vllm:spec_decode_num_accepted_tokens_per_pos"

# Chat deltas: reasoning parsers move text out of `content`.
OUTPUT_DELTA_KEYS = ("content", "reasoning_content", "reasoning", "tool_calls")

TIMING_CONVENTION = (
    "client-side; TTFT = request sent -> first output chunk; per-stream decode tok/s = "
    "tokens after the first output chunk / (last output chunk - first output chunk); "
    "aggregate tok/s = completion tokens of the level / level wall time (prefill and "
    "queueing included)"
)


class BenchError(RuntimeError):
    """A problem the user can fix; printed without a traceback."""


# --------------------------------------------------------------------------- metrics

_SAMPLE_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples of a Prometheus text exposition, by metric name."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        match = _SAMPLE_LINE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        label_map = dict(_LABEL.findall(labels or ""))
        samples.setdefault(name, []).append((label_map, float(value)))
    return samples


def _counter_samples(samples: dict, name: str) -> list[tuple[dict[str, str], float]] | None:
    # prometheus_client exposes counters with a `_total` suffix.
    return samples.get(name + "_total", samples.get(name))


@dataclass
class SpecCounters:
    """Server-wide spec-decode counters, summed over engines (data-parallel ranks)."""

    drafts: float
    draft_tokens: float
    accepted_tokens: float
    accepted_per_pos: list[float]

    @classmethod
    def from_metrics(cls, text: str) -> SpecCounters | None:
        """None when the server exports no spec-decode counters (no speculation)."""
        samples = parse_prometheus(text)
        totals: dict[str, float] = {}
        for key, name in SPEC_COUNTERS.items():
            found = _counter_samples(samples, name)
            if found is None:
                return None
            totals[key] = sum(value for _, value in found)
        per_pos: dict[int, float] = {}
        for labels, value in _counter_samples(samples, SPEC_PER_POS_COUNTER) or []:
            position = int(labels["position"])
            per_pos[position] = per_pos.get(position, 0.0) + value
        accepted_per_pos = [per_pos.get(i, 0.0) for i in range(max(per_pos, default=-1) + 1)]
        return cls(accepted_per_pos=accepted_per_pos, **totals)

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        after_pos, before_pos = self.accepted_per_pos, before.accepted_per_pos
        return SpecCounters(
            drafts=self.drafts - before.drafts,
            draft_tokens=self.draft_tokens - before.draft_tokens,
            accepted_tokens=self.accepted_tokens - before.accepted_tokens,
            accepted_per_pos=[
                (after_pos[i] if i < len(after_pos) else 0.0)
                - (before_pos[i] if i < len(before_pos) else 0.0)
                for i in range(max(len(after_pos), len(before_pos)))
            ],
        )

    @property
    def tau(self) -> float | None:
        """Tokens per verification step: accepted drafts plus the bonus token."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else None

    @property
    def acceptance_per_pos(self) -> list[float]:
        """P(draft position i accepted), per drafted block."""
        return [a / self.drafts for a in self.accepted_per_pos] if self.drafts else []

    @property
    def draft_acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None


# --------------------------------------------------------------------------- client


@dataclass
class StreamResult:
    """Client-side timing of one streamed request."""

    ttft_s: float | None = None
    decode_s: float | None = None
    completion_tokens: int = 0
    first_chunk_tokens: int = 1
    error: str | None = None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first chunk over the time after it; None when the whole
        answer arrived in one chunk."""
        decoded = self.completion_tokens - self.first_chunk_tokens
        if not self.decode_s or decoded < 1:
            return None
        return decoded / self.decode_s


class OpenAIEndpoint:
    """One OpenAI-compatible server: streamed requests and its /metrics page."""

    def __init__(self, url: str, model: str | None, api: str, timeout_s: float) -> None:
        self.base_url = url.rstrip("/").removesuffix("/v1")
        self.api = api
        self.timeout_s = timeout_s
        self.model = model or self._first_model()

    def _open(self, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            return urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise BenchError(f"{self.base_url}{path} answered HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise BenchError(
                f"cannot reach {self.base_url}{path} ({exc}); is the server up, and is the "
                "URL its root (e.g. http://HOST:8000)?"
            ) from None

    def _first_model(self) -> str:
        with self._open("/v1/models") as response:
            models = json.load(response).get("data", [])
        if not models:
            raise BenchError(f"{self.base_url}/v1/models lists no model; pass --model")
        return models[0]["id"]

    def metrics_text(self) -> str:
        with self._open("/metrics") as response:
            return response.read().decode()

    def spec_counters(self) -> SpecCounters | None:
        return SpecCounters.from_metrics(self.metrics_text())

    def _request_body(self, prompt: str, max_tokens: int, ignore_eos: bool) -> tuple[str, dict]:
        body = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos,
            # vLLM extension: token ids per chunk, to count the first chunk's tokens.
            "return_token_ids": True,
        }
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
            return "/v1/chat/completions", body
        body["prompt"] = prompt
        return "/v1/completions", body

    @staticmethod
    def _chunk_output(chunk: dict) -> tuple[bool, int | None]:
        """Whether a chunk carries generated output (text, reasoning or tool-call
        deltas, token ids), and its token count when the server returns token ids."""
        has_output, tokens = False, None
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            has_output |= any((choice.get("text"), *(delta.get(key) for key in OUTPUT_DELTA_KEYS)))
            if isinstance(choice.get("token_ids"), list):
                tokens = (tokens or 0) + len(choice["token_ids"])
        return has_output or bool(tokens), tokens

    def stream(self, prompt: str, max_tokens: int, ignore_eos: bool) -> StreamResult:
        path, body = self._request_body(prompt, max_tokens, ignore_eos)
        result = StreamResult()
        sent = time.perf_counter()
        first = last = None
        try:
            with self._open(path, body) as response:
                for raw in response:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data:") :])
                    has_output, tokens = self._chunk_output(chunk)
                    if has_output:
                        last = time.perf_counter()
                        if first is None:
                            first = last
                            result.first_chunk_tokens = tokens or 1
                    if chunk.get("usage"):
                        result.completion_tokens = chunk["usage"]["completion_tokens"]
        except (BenchError, OSError, ValueError) as exc:
            result.error = str(exc)
            return result
        if first is None:
            result.error = "the stream carried no output"
            return result
        result.ttft_s = first - sent
        result.decode_s = last - first
        if not result.completion_tokens:
            result.error = "the stream reported no usage; the server must support stream_options"
        return result


# --------------------------------------------------------------------------- sweep


@dataclass
class LevelResult:
    """One endpoint at one concurrency level."""

    concurrency: int
    requests: int
    errors: list[str]
    wall_s: float
    completion_tokens: int
    aggregate_tokens_per_s: float
    ttft_median_s: float | None
    ttft_p90_s: float | None
    per_stream_decode_tokens_per_s_median: float | None
    tau: float | None = None
    draft_acceptance_rate: float | None = None
    acceptance_per_pos: list[float] = field(default_factory=list)
    spec_counters: dict | None = None


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_level(
    endpoint: OpenAIEndpoint,
    prompts: list[str],
    concurrency: int,
    requests_per_stream: int,
    max_tokens: int,
    ignore_eos: bool,
) -> LevelResult:
    """`concurrency` closed-loop streams, each sending `requests_per_stream` requests."""
    before = endpoint.spec_counters()
    results: list[StreamResult] = []
    lock = threading.Lock()
    start = threading.Barrier(concurrency + 1)

    def worker(stream_index: int) -> None:
        start.wait()
        for i in range(requests_per_stream):
            prompt = prompts[(stream_index * requests_per_stream + i) % len(prompts)]
            result = endpoint.stream(prompt, max_tokens, ignore_eos)
            with lock:
                results.append(result)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    wall_s = time.perf_counter() - began
    after = endpoint.spec_counters()

    good = [r for r in results if r.error is None]
    tokens = sum(r.completion_tokens for r in good)
    ttfts = [r.ttft_s for r in good]
    rates = [r.decode_tokens_per_s for r in good if r.decode_tokens_per_s is not None]
    level = LevelResult(
        concurrency=concurrency,
        requests=len(results),
        errors=[r.error for r in results if r.error is not None],
        wall_s=wall_s,
        completion_tokens=tokens,
        aggregate_tokens_per_s=tokens / wall_s,
        ttft_median_s=statistics.median(ttfts) if ttfts else None,
        ttft_p90_s=_percentile(ttfts, 0.9),
        per_stream_decode_tokens_per_s_median=statistics.median(rates) if rates else None,
    )
    if before is not None and after is not None:
        delta = after - before
        level.tau = delta.tau
        level.draft_acceptance_rate = delta.draft_acceptance_rate
        level.acceptance_per_pos = delta.acceptance_per_pos
        level.spec_counters = asdict(delta)
    return level


# --------------------------------------------------------------------------- report


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(report: dict) -> str:
    rows = [
        f"{'C':>3} {'endpoint':<9} {'agg tok/s':>10} {'stream tok/s':>12} "
        f"{'TTFT ms':>8} {'tau':>5}  acceptance per position"
    ]
    for level in report["levels"]:
        for name in ("spec", "baseline"):
            run = level.get(name)
            if run is None:
                continue
            ttft_ms = None if run["ttft_median_s"] is None else 1000 * run["ttft_median_s"]
            per_pos = " ".join(f"{p:.2f}" for p in run["acceptance_per_pos"])
            rows.append(
                f"{run['concurrency']:>3} {name:<9} {run['aggregate_tokens_per_s']:>10.1f} "
                f"{_fmt(run['per_stream_decode_tokens_per_s_median']):>12} {_fmt(ttft_ms):>8} "
                f"{_fmt(run['tau'], 2):>5}  {per_pos}"
            )
        if "speedup_aggregate" in level:
            rows.append(
                f"{'':>3} {'ratio':<9} {level['speedup_aggregate']:>9.2f}x "
                f"{_fmt(level['speedup_per_stream'], 2):>11}x"
            )
    return "\n".join(rows)


def plot_report(report: dict, path: Path) -> bool:
    """PNG of tok/s per concurrency and acceptance per position; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    levels = report["levels"]
    concurrencies = [level["concurrency"] for level in levels]
    fig, (ax_speed, ax_accept) = plt.subplots(1, 2, figsize=(11, 4))
    for name, style in (("spec", "-o"), ("baseline", "--s")):
        runs = [level.get(name) for level in levels]
        if all(run is None for run in runs):
            continue
        agg = [run["aggregate_tokens_per_s"] if run else None for run in runs]
        per_stream = [run["per_stream_decode_tokens_per_s_median"] if run else None for run in runs]
        ax_speed.plot(concurrencies, agg, style, label=f"{name} aggregate")
        ax_speed.plot(concurrencies, per_stream, style, alpha=0.5, label=f"{name} per stream")
    ax_speed.set(xlabel="concurrency", ylabel="tokens/s", xscale="log", title="Decode speed")
    ax_speed.minorticks_off()
    ax_speed.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax_speed.legend()
    for level in levels:
        per_pos = (level.get("spec") or {}).get("acceptance_per_pos") or []
        if per_pos:
            ax_accept.plot(range(len(per_pos)), per_pos, "-o", label=f"C={level['concurrency']}")
    ax_accept.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1.05))
    ax_accept.xaxis.get_major_locator().set_params(integer=True)
    ax_accept.set_title("Acceptance per position (spec endpoint)")
    if ax_accept.lines:
        ax_accept.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- main


def load_prompts(path: Path | None) -> list[str]:
    if path is None:
        return list(DEFAULT_PROMPTS)
    try:
        prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise BenchError(f"cannot read --prompts file: {exc}") from None
    if not prompts:
        raise BenchError(f"--prompts file {path} holds no prompt (one prompt per line)")
    return prompts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="server root, e.g. http://HOST:8000")
    parser.add_argument("--baseline-url", help="same model served without speculation")
    parser.add_argument("--model", help="model name (default: the first one in /v1/models)")
    parser.add_argument("--api", choices=["completions", "chat"], default="completions")
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated levels")
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompts", type=Path, help="text file, one prompt per line")
    parser.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="let requests stop at EOS (default: always generate --max-tokens tokens)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request seconds")
    parser.add_argument("--output", type=Path, default=Path("serve_bench.json"))
    parser.add_argument("--plot", type=Path, help="PNG path (needs matplotlib)")
    args = parser.parse_args(argv)
    try:
        args.levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    if any(c < 1 for c in args.levels) or args.requests_per_stream < 1 or args.max_tokens < 2:
        parser.error("concurrency and --requests-per-stream must be >= 1, --max-tokens >= 2")
    return args


def run_benchmark(args: argparse.Namespace) -> dict:
    prompts = load_prompts(args.prompts)
    endpoints = {"spec": OpenAIEndpoint(args.url, args.model, args.api, args.timeout)}
    if args.baseline_url:
        model = args.model or endpoints["spec"].model
        endpoints["baseline"] = OpenAIEndpoint(args.baseline_url, model, args.api, args.timeout)
    ignore_eos = not args.no_ignore_eos
    for endpoint in endpoints.values():  # warm-up, not measured
        warm = endpoint.stream(prompts[0], min(args.max_tokens, 16), ignore_eos)
        if warm.error:
            raise BenchError(f"warm-up request to {endpoint.base_url} failed: {warm.error}")
    levels = []
    for concurrency in args.levels:
        level: dict = {"concurrency": concurrency}
        for name, endpoint in endpoints.items():  # alternate endpoints level by level
            result = run_level(
                endpoint,
                prompts,
                concurrency,
                args.requests_per_stream,
                args.max_tokens,
                ignore_eos,
            )
            level[name] = asdict(result)
        if "baseline" in level and level["baseline"]["aggregate_tokens_per_s"]:
            spec, base = level["spec"], level["baseline"]
            level["speedup_aggregate"] = (
                spec["aggregate_tokens_per_s"] / base["aggregate_tokens_per_s"]
            )
            a = spec["per_stream_decode_tokens_per_s_median"]
            b = base["per_stream_decode_tokens_per_s_median"]
            level["speedup_per_stream"] = a / b if a and b else None
        levels.append(level)
    return {
        "meta": {
            "url": endpoints["spec"].base_url,
            "baseline_url": endpoints["baseline"].base_url if "baseline" in endpoints else None,
            "model": endpoints["spec"].model,
            "api": args.api,
            "max_tokens": args.max_tokens,
            "ignore_eos": ignore_eos,
            "requests_per_stream": args.requests_per_stream,
            "num_prompts": len(prompts),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "timing_convention": TIMING_CONVENTION,
            "tau_definition": "1 + accepted / drafts (vLLM's accepted counter excludes the bonus)",
        },
        "levels": levels,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = run_benchmark(args)
    except BenchError as exc:
        print(f"serve_bench: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(report))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")
    if args.plot:
        if plot_report(report, args.plot):
            print(f"wrote {args.plot}")
        else:
            print("matplotlib is not installed: no plot written (pip install matplotlib)")
    failures = sum(len(run["errors"]) for lvl in report["levels"] for run in _runs(lvl))
    if failures:
        print(
            f"serve_bench: {failures} request(s) failed; see 'errors' in the JSON", file=sys.stderr
        )
        return 1
    return 0


def _runs(level: dict) -> list[dict]:
    return [level[name] for name in ("spec", "baseline") if name in level]


if __name__ == "__main__":
    sys.exit(main())
