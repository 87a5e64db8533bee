# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""CUDA graphs on CPU: vLLM's sizing with the values a CUDA host starts from, and a stand-in for
vLLM's graph wrapper that runs the captured function.

vLLM's CPU platform turns CUDA graphs off while a config is built. ``size_as_on_cuda`` puts
back what a CUDA host has (a cudagraph mode, the capture flags a deployment passes) and runs
vLLM's own ``VllmConfig._set_cudagraph_sizes`` (its capture grid, which cuts a maximum to the
grid); the runner's ``resolve_cudagraph_mode_and_sizes`` (the rounding to multiples of k + 1)
then runs through ``capture_plan`` or the runner itself. ``profile_sizing_args`` reads a
launcher profile's rendered ``vllm serve`` arguments with vLLM's own engine-argument parser.
``PassThroughGraph`` stands in for ``CUDAGraphWrapper`` (CPU has no CUDA graphs), and
``graphs_on_cpu`` makes a proposer plan, capture and replay its draft graphs through it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import ClassVar

import pytest
import yaml

from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode


def size_as_on_cuda(
    vllm_config: VllmConfig,
    mode: CUDAGraphMode,
    max_capture_size: int | None = None,
    capture_sizes: list[int] | None = None,
    monkeypatch: pytest.MonkeyPatch | None = None,
) -> None:
    """Give ``vllm_config`` a CUDA host's graph settings and run vLLM's capture sizing on it
    (through ``monkeypatch`` when given, so that a shared engine gets its values back)."""
    setattr_ = monkeypatch.setattr if monkeypatch is not None else setattr
    compilation_config = vllm_config.compilation_config
    setattr_(vllm_config.model_config, "enforce_eager", False)
    setattr_(compilation_config, "cudagraph_mode", mode)
    setattr_(compilation_config, "max_cudagraph_capture_size", max_capture_size)
    setattr_(compilation_config, "cudagraph_capture_sizes", capture_sizes)
    vllm_config._set_cudagraph_sizes()


@dataclass(frozen=True)
class SizingArgs:
    """The ``vllm serve`` values that decide the CUDA-graph capture sizes."""

    max_num_seqs: int
    max_num_batched_tokens: int | None
    num_speculative_tokens: int
    draft_sample_method: str | None
    cuda_graphs: bool
    max_capture_size: int | None
    capture_sizes: list[int] | None

    def tiny_v4_config(self, model_dir: Path) -> VllmConfig:
        """A tiny DeepSeek-V4 target's config with these values (k drafts of a DSpark head)."""
        from vllm.engine.arg_utils import EngineArgs

        speculative = None
        if self.num_speculative_tokens:
            speculative = {
                "method": "dspark",
                "num_speculative_tokens": self.num_speculative_tokens,
                "draft_sample_method": self.draft_sample_method or "greedy",
            }
        return EngineArgs(
            model=str(model_dir),
            dtype="bfloat16",
            max_model_len=1024,
            skip_tokenizer_init=True,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            speculative_config=speculative,
        ).create_engine_config()


def rendered_serve_args(profile_name: str, tmp_path: Path) -> tuple[str, ...]:
    """The head rank's ``vllm serve`` arguments for a shipped profile, as the launcher renders
    them on a local site."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
    from dspark_launch.profile import PROFILES_DIR, load_profile
    from dspark_launch.render import serve_args
    from dspark_launch.site import load_site

    node = {"address": "127.0.0.1", "hf_home": str(tmp_path), "state_dir": str(tmp_path)}
    site_file = tmp_path / "site.yaml"
    site_file.write_text(
        yaml.safe_dump(
            {
                "profile": profile_name,
                "mode": "local",
                "venv": str(tmp_path),
                "api_bind": "127.0.0.1",
                "ports": {"api": 18000, "master": 29500},
                "head": node,
                "worker": node,
            }
        )
    )
    site_file.chmod(0o600)
    site = load_site(site_file)
    profile = load_profile(PROFILES_DIR / f"{profile_name}.yaml")
    return serve_args(profile, site, site.nodes[0])


def profile_sizing_args(serve_args: tuple[str, ...], model_dir: Path) -> SizingArgs:
    """Read rendered ``vllm serve`` arguments (the model first, here replaced by a local
    ``model_dir``: offline, vLLM resolves the model while it reads the arguments) with vLLM's
    engine-argument parser; serve-only flags are left aside."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    namespace, _ = parser.parse_known_args(["--model", str(model_dir), *serve_args[1:]])
    args = EngineArgs.from_cli_args(namespace)
    speculative = args.speculative_config or {}
    compilation = args.compilation_config
    return SizingArgs(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_speculative_tokens=speculative.get("num_speculative_tokens", 0),
        draft_sample_method=speculative.get("draft_sample_method"),
        cuda_graphs=not args.enforce_eager,
        max_capture_size=args.max_cudagraph_capture_size or compilation.max_cudagraph_capture_size,
        capture_sizes=args.cudagraph_capture_sizes or compilation.cudagraph_capture_sizes,
    )


class PassThroughGraph:
    """Stands in for vLLM's ``CUDAGraphWrapper`` on CPU: under a FULL forward context the first
    call for a batch descriptor "captures" (holds an entry, as the wrapper does), later ones
    "replay" by running the function; other modes run it plainly, as the wrapper does."""

    calls: ClassVar[list[tuple[str, int]]] = []

    def __init__(self, runnable, vllm_config, runtime_mode) -> None:
        self.runnable, self.runtime_mode = runnable, runtime_mode
        self.concrete_cudagraph_entries: dict = {}

    def __call__(self, size: int):
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        if context.cudagraph_runtime_mode != CUDAGraphMode.FULL:
            return self.runnable(size)
        descriptor = context.batch_descriptor
        assert descriptor.num_reqs == size
        captured = descriptor in self.concrete_cudagraph_entries
        self.calls.append(("replay" if captured else "capture", size))
        self.concrete_cudagraph_entries.setdefault(descriptor, SimpleNamespace(cudagraph=object()))
        return self.runnable(size)


def graphs_on_cpu(monkeypatch: pytest.MonkeyPatch, proposer_module: ModuleType) -> None:
    """``proposer_module``'s proposer plans its draft graphs as on CUDA; they capture and
    replay through ``PassThroughGraph``."""
    from vllm.v1.spec_decode.dspark import cudagraph

    cuda = SimpleNamespace(is_cuda_alike=lambda: True)
    monkeypatch.setattr(proposer_module, "current_platform", cuda)
    monkeypatch.setattr(cudagraph, "CUDAGraphWrapper", PassThroughGraph)
    PassThroughGraph.calls = []


# Each engine of a graph-vs-eager comparison runs a greedy batch, then one mixing greedy and
# sampled requests (one request's temperature each).
TEMPERATURES = {"greedy": [0.0, 0.0, 0.0], "sampled": [0.0, 0.8, 1.0]}


def record_replays(graphs, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, bool]]:
    """Every ``draft`` of ``graphs`` (``DraftGraphs``, whose calls end with the anchor tokens,
    the size and the sampling metadata, or ``ChainGraphs``, whose calls are the ``[B * k, H]``
    hidden states, the size and the sampling metadata) as (requests, size, sampled)."""
    from vllm.v1.spec_decode.dspark.cudagraph import ChainGraphs

    replayed: list[tuple[int, int, bool]] = []
    draft = graphs.draft
    rows_per_request = graphs.num_drafts if isinstance(graphs, ChainGraphs) else 1

    def recorded(*args):
        rows, size, metadata = args[-3:]
        replayed.append((rows.shape[0] // rows_per_request, size, metadata is not None))
        return draft(*args)

    monkeypatch.setattr(graphs, "draft", recorded)
    return replayed


def draft_steps(engine) -> dict[str, float]:
    """``vllm:spec_decode_draft_steps`` by its ``cudagraph_mode`` label."""
    return {
        metric.labels["cudagraph_mode"]: metric.value
        for metric in engine.llm.get_metrics()
        if metric.name == "vllm:spec_decode_draft_steps"
    }


def run_batches(
    engine, prompts: list[list[int]], max_tokens: list[int], replayed: list, log: Path
) -> dict:
    """The ``TEMPERATURES`` batches, the global generator reseeded before each (the draft
    sampler draws from it; the target's sampler uses per-request seeds): per batch the tokens,
    the draft steps counted by mode and the replays; and every logged draft."""
    import torch

    from dspark_fixtures.engine import read_draft_log
    from vllm import SamplingParams

    runs: dict = {}
    for kind, temperatures in TEMPERATURES.items():
        params = [
            SamplingParams(temperature=t, seed=i, max_tokens=n, ignore_eos=True)
            for i, (t, n) in enumerate(zip(temperatures, max_tokens, strict=True))
        ]
        before = draft_steps(engine)
        torch.manual_seed(1234)
        outputs = engine.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        steps = draft_steps(engine)
        runs[kind] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "steps": {mode: steps[mode] - before[mode] for mode in steps},
            "replayed": list(replayed),
        }
        replayed.clear()
    runs["log"] = {
        request: {anchor: (r["anchor_token"], r["drafts"]) for anchor, r in records.items()}
        for request, records in read_draft_log(log).items()
    }
    return runs
