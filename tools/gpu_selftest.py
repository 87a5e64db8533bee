#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""GPU self-test of a DSpark vLLM install: what the CPU test suite cannot prove, in one command.

Run it with the Python of the vLLM that serves (inside the image on each node; `dspark-launch
preflight` pipes this file to `python3 - --json` there). Every check names what it needs; on a
host without CUDA the CUDA checks report "skipped: needs CUDA" and the rest run, so CI runs this
file too (tests/tools/test_gpu_selftest.py). The exit status is 0 only when every check that ran
passed.

Checks:
- device: name, compute capability, memory (needs CUDA);
- architectures: the machine code (SASS) and PTX that torch, vLLM's extensions and FlashInfer
  carry, against the device's (or `--arch`) architecture, with a verdict per binary:
  "sass" (runs natively), "ptx-jit" (runs after a JIT compile at first use) or "none" (no
  kernel image: it fails at the first launch);
- ring: DSpark's context-ring step on random ragged batches, CUDA under
  `torch.cuda.set_sync_debug_mode("error")` against the CPU; on a CPU host, the CPU against a
  plain-loop reference;
- draft graphs: one draft step of each family with tiny random weights (Qwen3: the block
  layout and Markov chain of `dspark/block.py`, `dspark/markov.py`; DeepSeek-V4: the ring and
  `BlockDrafter` of `dspark/drafter.py` around a tiny torch backbone), captured in a CUDA graph
  and replayed against eager over ragged steps (needs CUDA; on a CPU host only the eager path
  runs);
- deferred copy: a host-to-device copy consumed one step later, from a fresh pinned tensor per
  step and from one reused pinned tensor, with the copies made really asynchronous (needs CUDA);
- rms_norm: vLLM's `ops.rms_norm` with a stacked `[L, head_dim]` weight against a per-layer
  loop, the kernel contract the Qwen3 DFlash context K-norm relies on; the result is a fact
  ("<device>: stacked weight indexed by row" or "... not indexed by row"), not a failure;
- draft state: the DeepSeek-V4 ring's bytes at the serving profile's sizes, allocated on the
  device and compared with the count from its geometry.
Nothing CUDA-only is imported at module level.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
NEEDS_CUDA = "needs CUDA"
# DeepSeek-V4-Flash's ring geometry (its config.json: sliding_window, 3 tapped stages,
# head_dim) and the Spark profile's max_num_seqs (recipe/profiles/deepseek-v4-flash-2x-spark).
V4_FLASH_RING = {"window": 128, "stages": 3, "head_dim": 512}
SPARK_MAX_NUM_SEQS = 6


@dataclass
class Outcome:
    status: str
    detail: str
    facts: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Check:
    name: str
    needs: str
    run: Callable[[argparse.Namespace], Outcome]
    cuda_only: bool = False


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# --- architectures ------------------------------------------------------------------------

_ARCH = re.compile(r"\b(sm|compute)_(\d+)([af]?)\b")


def parse_arch(text: str) -> tuple[int, int, str] | None:
    """`sm_121a` -> (12, 1, "a"); `compute_90` -> (9, 0, ""); anything else -> None."""
    match = _ARCH.search(text)
    if not match:
        return None
    number = int(match[2])
    return number // 10, number % 10, match[3]


def code_runs_on(code: tuple[int, int, str], device: tuple[int, int]) -> bool:
    """Whether code built for `code` loads on a device of compute capability `device`.

    CUDA's rules: plain code for X.y runs on X.z with z >= y (PTX: on any later device, after
    a JIT compile); `a` (architecture-specific) code only on exactly X.y; `f` (family) code on
    X.z with z >= y.
    """
    major, minor, suffix = code
    if suffix == "a":
        return (major, minor) == device
    return major == device[0] and minor <= device[1]


def ptx_runs_on(code: tuple[int, int, str], device: tuple[int, int]) -> bool:
    major, minor, suffix = code
    if suffix:
        return code_runs_on(code, device)
    return (major, minor) <= device


def arch_verdict(sass: list[str], ptx: list[str], device: tuple[int, int]) -> str:
    """ "sass", "ptx-jit" or "none" for a binary's listings on `device`."""
    if any((c := parse_arch(a)) and code_runs_on(c, device) for a in sass):
        return "sass"
    if any((c := parse_arch(a)) and ptx_runs_on(c, device) for a in ptx):
        return "ptx-jit"
    return "none"


_LISTED = re.compile(r"\.(sm|compute)_(\d+[af]?)\.(?:cubin|ptx)\s*$", re.MULTILINE)


def parse_cuobjdump(text: str) -> list[str]:
    """Architectures named by `cuobjdump --list-elf`/`--list-ptx` lines such as
    `ELF file    1: _C.1.sm_120a.cubin` or `PTX file    1: _C.1.sm_90.ptx`."""
    return sorted({f"sm_{m[2]}" for m in _LISTED.finditer(text)})


def cuobjdump_listing(cuobjdump: str, path: Path) -> tuple[list[str], list[str]]:
    """(SASS archs, PTX archs) embedded in one shared object."""
    sass, ptx = (
        parse_cuobjdump(
            subprocess.run(
                [cuobjdump, option, str(path)], capture_output=True, text=True, check=False
            ).stdout
        )
        for option in ("--list-elf", "--list-ptx")
    )
    return sass, [a.replace("sm_", "compute_") for a in ptx]


def find_cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (candidate := Path(home) / "bin" / "cuobjdump").is_file():
            return str(candidate)
    return None


def package_binaries() -> dict[str, Path]:
    """Shared objects of vLLM (its extensions, its FlashAttention build) and FlashInfer, where
    installed, named `package/relative/path.so`."""
    import importlib.util

    binaries = {}
    for package in ("vllm", "flashinfer"):
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            continue
        root = Path(spec.origin).parent
        for path in sorted(root.glob("**/*.so")):
            binaries[f"{package}/{path.relative_to(root)}"] = path
    return binaries


def collect_listing() -> dict[str, dict[str, list[str]]]:
    """{component: {"sass": [...], "ptx": [...]}} of what this install carries.

    torch: the architectures it was compiled for (`_cuda_getArchFlags`, no device needed);
    vLLM and FlashInfer: each shared object through cuobjdump (absent -> not listed).
    """
    import torch

    listing: dict[str, dict[str, list[str]]] = {}
    flags = torch._C._cuda_getArchFlags() if hasattr(torch._C, "_cuda_getArchFlags") else ""
    archs = (flags or "").split()
    listing["torch"] = {
        "sass": [a for a in archs if a.startswith("sm_")],
        "ptx": [a for a in archs if a.startswith("compute_")],
    }
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        return listing
    for name, path in package_binaries().items():
        sass, ptx = cuobjdump_listing(cuobjdump, path)
        if sass or ptx:
            listing[name] = {"sass": sass, "ptx": ptx}
    return listing


def required_component(name: str) -> bool:
    """Binaries a DSpark deployment cannot run without: torch and vLLM's core extensions."""
    return name == "torch" or name.startswith(("vllm/_C.", "vllm/_moe_C."))


def architecture_problems(
    listing: dict[str, dict[str, list[str]]], device: tuple[int, int], require_vllm: bool
) -> tuple[dict[str, str], list[str]]:
    """Each binary's verdict on `device`, and what carries no code for it: torch, vLLM's
    `_C`/`_moe_C`, FlashInfer as a whole; with `require_vllm` (the image build), vLLM's `_C`
    must be in the listing at all. Other binaries (kernels built for one architecture on
    purpose) are reported, not required."""
    verdicts = {
        name: arch_verdict(entry.get("sass", []), entry.get("ptx", []), device)
        for name, entry in listing.items()
    }
    missing = [n for n, v in verdicts.items() if v == "none" and required_component(n)]
    if require_vllm and not any(name.startswith("vllm/_C.") for name in verdicts):
        missing.append("vllm/_C (not listed: no cuobjdump, or no CUDA code in it)")
    flashinfer = [v for n, v in verdicts.items() if n.startswith("flashinfer/")]
    if flashinfer and all(v == "none" for v in flashinfer):
        missing.append("flashinfer (every binary)")
    return verdicts, missing


def jit_list_problems(name: str, value: str, targets: list[tuple[int, int]]) -> list[str]:
    """Targets an arch list such as TORCH_CUDA_ARCH_LIST="10.0a 12.0a" compiles nothing for."""
    entries = []
    for token in value.replace(";", " ").split():
        base, ptx = token.removesuffix("+PTX"), token.endswith("+PTX")
        match = re.fullmatch(r"(\d+)\.(\d)([af]?)", base)
        if match:
            entries.append(((int(match[1]), int(match[2]), match[3]), ptx))
    return [
        f"{name}={value!r} covers no {format_arch(target)}"
        for target in targets
        if not any(
            code_runs_on(code, target) or (ptx and ptx_runs_on(code, target))
            for code, ptx in entries
        )
    ]


def format_arch(device: tuple[int, int]) -> str:
    return f"sm_{device[0]}{device[1]}"


def check_device(args: argparse.Namespace) -> Outcome:
    import torch

    properties = torch.cuda.get_device_properties(0)
    facts = {
        "name": properties.name,
        "capability": format_arch((properties.major, properties.minor)),
        "memory_gib": round(properties.total_memory / 2**30, 2),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "devices": torch.cuda.device_count(),
    }
    return Outcome(
        PASSED, f"{facts['name']}, {facts['capability']}, {facts['memory_gib']} GiB", facts
    )


def check_architectures(args: argparse.Namespace) -> Outcome:
    import torch

    if args.arch:
        parsed = parse_arch(args.arch)
        if parsed is None:
            return Outcome(FAILED, f"--arch {args.arch!r} is not an architecture like sm_121")
        device = parsed[:2]
    else:
        device = torch.cuda.get_device_capability(0)
    listing = collect_listing()
    verdicts, missing = architecture_problems(listing, device, require_vllm=False)
    facts = {"device": format_arch(device), "verdicts": verdicts, "listing": listing}
    if find_cuobjdump() is None:
        facts["note"] = "cuobjdump not found: vLLM and FlashInfer binaries not listed"
    summary = ", ".join(f"{name}: {verdict}" for name, verdict in sorted(verdicts.items())[:6])
    if missing:
        return Outcome(
            FAILED,
            f"no machine code or PTX for {format_arch(device)} in {', '.join(missing)}",
            facts,
        )
    return Outcome(PASSED, f"{format_arch(device)}: {summary}", facts)


# --- ring ---------------------------------------------------------------------------------


def ragged_ring_steps(steps: int, num_slots: int, window: int, seed: int) -> list[dict]:
    """Random ragged steps: requests with prefill chunks (some longer than the window) and
    decodes, rejected rows, padding rows, and fresh slots."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    next_position = [0] * (num_slots - 1)
    out = []
    for _ in range(steps):
        requests = int(torch.randint(1, num_slots, (1,), generator=generator))
        slots = torch.randperm(num_slots - 1, generator=generator)[:requests]
        fresh = slots[torch.rand(requests, generator=generator) < 0.2]
        for slot in fresh.tolist():
            next_position[slot] = 0
        lengths = torch.randint(1, 2 * window + 2, (requests,), generator=generator)
        rejected = torch.minimum(torch.randint(0, 3, (requests,), generator=generator), lengths - 1)
        positions = []
        for slot, length, rejects in zip(
            slots.tolist(), lengths.tolist(), rejected.tolist(), strict=True
        ):
            start = next_position[slot]
            positions += list(range(start, start + length))
            next_position[slot] = start + length - rejects
        num_pad = int(torch.randint(0, 3, (1,), generator=generator))
        rows = len(positions) + num_pad
        out.append(
            {
                "query_start_loc": torch.cat([torch.zeros(1), lengths.cumsum(0)]).to(torch.int32),
                "num_valid": lengths - rejected,
                "slots_per_request": torch.cat([slots, torch.tensor([num_slots - 1])]),
                "fresh": fresh,
                "positions": torch.tensor(positions + [0] * num_pad),
                "values": torch.randn(rows, 2, generator=generator),
                "anchors": torch.tensor(
                    [next_position[s] - 1 for s in slots.tolist()], dtype=torch.int64
                ),
            }
        )
    return out


def ring_step(ring, t: dict):
    """Everything the ring proposer does with the ring in one step."""
    from vllm.v1.spec_decode.dspark.ring import rows_to_requests, valid_row_mask

    row_to_request = rows_to_requests(t["query_start_loc"], t["positions"].shape[0])
    valid = valid_row_mask(t["query_start_loc"], row_to_request, t["num_valid"])
    ring.invalidate(t["fresh"])
    ring.write(t["slots_per_request"][row_to_request], t["positions"], valid, t["values"])
    requests = t["slots_per_request"].shape[0] - 1
    return ring.read(t["slots_per_request"][:requests], t["anchors"])


def reference_ring_step(state: dict, window: int, t: dict):
    """The ring step as a plain loop: valid rows written one at a time in position order."""
    import torch

    for slot in t["fresh"].tolist():
        state[slot] = {}
    qsl, num_valid = t["query_start_loc"].tolist(), t["num_valid"].tolist()
    slots = t["slots_per_request"].tolist()
    for request in range(len(qsl) - 1):
        rows = range(qsl[request], qsl[request] + num_valid[request])
        for row in sorted(rows, key=lambda r: int(t["positions"][r])):
            position = int(t["positions"][row])
            state.setdefault(slots[request], {})[position % window] = (position, t["values"][row])
    values, masks = [], []
    for request, anchor in enumerate(t["anchors"].tolist()):
        entries = state.get(slots[request], {})
        row_values = torch.zeros(window, 2)
        row_mask = torch.zeros(window, dtype=torch.bool)
        for entry, (tag, value) in entries.items():
            row_values[entry] = value
            row_mask[entry] = anchor - window < tag <= anchor
        values.append(row_values)
        masks.append(row_mask)
    return torch.stack(values), torch.stack(masks)


def check_ring(args: argparse.Namespace) -> Outcome:
    import torch

    from vllm.v1.spec_decode.dspark.ring import ContextRing

    num_slots, window, steps = 6, 8, 40
    cpu_ring = ContextRing(num_slots, window, (2,), torch.float32, torch.device("cpu"))
    if not cuda_available():
        state: dict = {}
        for index, t in enumerate(ragged_ring_steps(steps, num_slots, window, seed=1)):
            values, mask = ring_step(cpu_ring, t)
            ref_values, ref_mask = reference_ring_step(state, window, t)
            if not torch.equal(mask, ref_mask) or not torch.equal(values[mask], ref_values[mask]):
                return Outcome(
                    FAILED, f"cpu ring differs from the plain-loop reference at step {index}"
                )
        return Outcome(
            PASSED,
            f"cpu: {steps} ragged steps equal a plain-loop reference; "
            f"the CUDA comparison under sync_debug_mode('error') {NEEDS_CUDA}",
        )
    device = torch.device("cuda")
    cuda_ring = ContextRing(num_slots, window, (2,), torch.float32, device)
    for index, t in enumerate(ragged_ring_steps(steps, num_slots, window, seed=1)):
        expected, expected_mask = ring_step(cpu_ring, t)
        on_device = {name: tensor.to(device) for name, tensor in t.items()}
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            values, mask = ring_step(cuda_ring, on_device)
        except RuntimeError as e:
            return Outcome(FAILED, f"step {index} synchronized with the host: {e}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        mask = mask.cpu()
        if not torch.equal(mask, expected_mask) or not torch.equal(
            values.cpu()[mask], expected[expected_mask]
        ):
            return Outcome(FAILED, f"CUDA ring differs from the CPU ring at step {index}")
    return Outcome(PASSED, f"cuda: {steps} ragged steps equal the CPU ring, no host sync")


# --- draft steps in CUDA graphs -----------------------------------------------------------


def tiny_v4_drafter(device, seed: int):
    """`BlockDrafter` over a real `ContextRing` with a tiny random torch backbone and heads."""
    import torch
    from torch import nn

    from vllm.v1.spec_decode.dspark.backbone import DSparkBackbone
    from vllm.v1.spec_decode.dspark.drafter import BlockDrafter
    from vllm.v1.spec_decode.dspark.ring import ContextRing

    vocab, hidden, features, stages, head_dim, rank = 64, 32, 24, 2, 16, 8

    class Backbone(DSparkBackbone):
        def __init__(self) -> None:
            super().__init__()
            self.window, self.ring_entry_shape, self.hidden_size = 8, (stages, head_dim), hidden
            self.project = nn.Linear(features, stages * head_dim)
            self.query = nn.Linear(hidden, head_dim)
            self.key = nn.Linear(hidden, head_dim)
            self.out = nn.Linear(head_dim, hidden)

        def context_entries(self, target_features, positions):
            return self.project(target_features).view(-1, stages, head_dim)

        def block_hidden(self, block_embeds, block_positions, context, context_positions, mask):
            phase = torch.sin(block_positions.float().unsqueeze(-1) * 0.1)
            query = self.query(block_embeds) + phase
            keys = torch.cat([context.mean(2), self.key(block_embeds)], dim=1)
            attend = torch.cat([mask, mask.new_ones(block_embeds.shape[:2])], dim=1)
            scores = query @ keys.transpose(1, 2) / math.sqrt(head_dim)
            scores = scores.masked_fill(~attend.unsqueeze(1), float("-inf"))
            hidden_out = block_embeds + self.out(scores.softmax(-1) @ keys)
            return hidden_out, hidden_out

    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden)
            self.lm_head = nn.Linear(hidden, vocab)
            self.w1 = nn.Embedding(vocab, rank)
            self.w2 = nn.Linear(rank, vocab, bias=False)
            self.conf = nn.Linear(hidden + rank, 1)

        def embed_input_ids(self, input_ids):
            return self.embed(input_ids)

        def compute_logits(self, hidden_states):
            return self.lm_head(hidden_states)

        def markov_embed(self, token_ids):
            return self.w1(token_ids)

        def markov_bias(self, embed):
            return self.w2(embed)

        def compute_confidence(self, hidden_states, embed):
            return torch.sigmoid(self.conf(torch.cat([hidden_states, embed], -1))).squeeze(-1)

    torch.manual_seed(seed)
    backbone, heads = Backbone().to(device), Heads().to(device)
    ring = ContextRing(7, backbone.window, backbone.ring_entry_shape, torch.float32, device)
    drafter = BlockDrafter(backbone, heads, ring, vocab - 1, 1 << 20, max_num_drafts=4)
    return drafter, features, vocab


def v4_steps(steps: int, requests: int, rows: int, features: int, vocab: int, seed: int):
    """Ragged steps of fixed shape (so one graph replays them): random chunk lengths, rejected
    drafts and padding rows; each request's positions continue from its last valid one."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    next_position = [0] * requests
    out = []
    for _ in range(steps):
        lengths = torch.randint(1, rows // requests + 1, (requests,), generator=generator)
        rejected = torch.minimum(torch.randint(0, 3, (requests,), generator=generator), lengths - 1)
        positions = []
        for request, (length, rejects) in enumerate(
            zip(lengths.tolist(), rejected.tolist(), strict=True)
        ):
            start = next_position[request]
            positions += list(range(start, start + length))
            next_position[request] = start + length - rejects
        positions += [0] * (rows - len(positions))
        out.append(
            {
                "request_slots": torch.arange(requests),
                "target_features": torch.randn(rows, features, generator=generator),
                "positions": torch.tensor(positions),
                "query_start_loc": torch.cat([torch.zeros(1), lengths.cumsum(0)]).long(),
                "num_rejected": rejected,
                "anchor_tokens": torch.randint(0, vocab - 1, (requests,), generator=generator),
            }
        )
    return out


def tiny_qwen3_step(device, seed: int):
    """One Qwen3-family draft step at torch level: DeepSpec's block (`dspark/block.py`) over a
    ragged per-request context, then the Markov chain (`dspark/markov.py`)."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from vllm.v1.spec_decode.dspark.block import num_block_drafts, num_block_queries
    from vllm.v1.spec_decode.dspark.markov import markov_chain

    vocab, hidden, rank, k = 64, 32, 8, 3
    config = SimpleNamespace(block_size=5, sample_from_anchor=True)
    queries, drafts = num_block_queries(config, k), num_block_drafts(config, k)
    torch.manual_seed(seed)
    embed = nn.Embedding(vocab, hidden).to(device)
    qkv = nn.Linear(hidden, 3 * hidden).to(device)
    lm_head = nn.Linear(hidden, vocab).to(device)
    w1, w2 = nn.Embedding(vocab, rank).to(device), nn.Linear(rank, vocab, bias=False).to(device)
    offsets = torch.arange(queries, device=device)

    def step(context, context_lengths, anchor_tokens):
        block_ids = torch.full((anchor_tokens.shape[0], queries), vocab - 1, device=device)
        block_ids[:, 0] = anchor_tokens
        block = embed(block_ids) + torch.sin(
            (context_lengths.unsqueeze(1) + offsets).float().unsqueeze(-1) * 0.1
        )
        q, key, value = qkv(block).chunk(3, dim=-1)
        keys = torch.cat([context, key], 1)
        values = torch.cat([context, value], 1)
        slots = torch.arange(context.shape[1], device=device)
        attend = torch.cat(
            [slots < context_lengths.unsqueeze(1), block_ids.new_ones(block_ids.shape).bool()], 1
        )
        scores = (q @ keys.transpose(1, 2)).masked_fill(~attend.unsqueeze(1), float("-inf"))
        hidden_out = block + scores.softmax(-1) @ values
        logits = lm_head(hidden_out[:, :drafts])
        return markov_chain(logits, anchor_tokens, w1, w2).token_ids[:, :k]

    return step, vocab, hidden


def qwen3_steps(steps: int, requests: int, max_context: int, hidden: int, vocab: int, seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [
        {
            "context": torch.randn(requests, max_context, hidden, generator=generator),
            "context_lengths": torch.randint(1, max_context + 1, (requests,), generator=generator),
            "anchor_tokens": torch.randint(0, vocab - 1, (requests,), generator=generator),
        }
        for _ in range(steps)
    ]


def graph_against_eager(make_step, inputs: list[dict], device) -> str | None:
    """Capture `make_step()` once on static buffers, replay it for every input and compare with
    an independently built eager step fed the same inputs; the first mismatch, else None."""
    import torch

    eager, graphed = make_step(), make_step()
    static = {name: tensor.to(device) for name, tensor in inputs[0].items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graphed.warm_up(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = graphed.run(static)
    graphed.reset()
    for index, step_inputs in enumerate(inputs):
        for name, tensor in step_inputs.items():
            static[name].copy_(tensor)
        graph.replay()
        expected = eager.run({name: tensor.to(device) for name, tensor in step_inputs.items()})
        torch.cuda.synchronize()
        for got, want in zip(output, expected, strict=True):
            if got is None:
                continue
            if got.dtype.is_floating_point:
                if not torch.allclose(got, want, atol=1e-5, rtol=1e-4):
                    return f"step {index}: replayed {tuple(got.shape)} differs from eager"
            elif not torch.equal(got, want):
                return f"step {index}: replayed drafts {got.tolist()} != eager {want.tolist()}"
    return None


class V4Step:
    """The V4 drafter's `step` on one input dict; `reset` empties its ring."""

    def __init__(self, device, seed: int) -> None:
        self.drafter, self.features, self.vocab = tiny_v4_drafter(device, seed)

    def run(self, t: dict):
        out = self.drafter.step(
            t["request_slots"],
            t["target_features"],
            t["positions"],
            t["query_start_loc"],
            t["num_rejected"],
            t["anchor_tokens"],
            num_drafts=4,
            with_confidence=True,
        )
        return out.token_ids, out.confidence, out.anchors

    def warm_up(self, t: dict) -> None:
        for _ in range(2):
            self.run(t)
        self.reset()

    def reset(self) -> None:
        ring = self.drafter.ring
        ring._flat_tags.fill_(-1)
        ring._flat_values.zero_()


class Qwen3Step:
    def __init__(self, device, seed: int) -> None:
        self.step, self.vocab, self.hidden = tiny_qwen3_step(device, seed)

    def run(self, t: dict):
        return (self.step(t["context"], t["context_lengths"], t["anchor_tokens"]),)

    def warm_up(self, t: dict) -> None:
        for _ in range(2):
            self.run(t)

    def reset(self) -> None:
        """Stateless: the context arrives with each step."""


def draft_inputs(seed: int = 3) -> dict[str, tuple[Callable, list[dict]]]:
    """Each family's step class and its ragged steps (12 steps of 3 requests)."""
    import torch

    cpu = torch.device("cpu")
    v4, qwen3 = V4Step(cpu, 0), Qwen3Step(cpu, 0)
    return {
        "deepseek_v4": (V4Step, v4_steps(12, 3, 24, v4.features, v4.vocab, seed)),
        "qwen3": (Qwen3Step, qwen3_steps(12, 3, 10, qwen3.hidden, qwen3.vocab, seed)),
    }


def check_draft_graphs(args: argparse.Namespace) -> Outcome:
    import torch

    families = draft_inputs()
    if not cuda_available():
        cpu = torch.device("cpu")
        ran = []
        for family, (step_class, inputs) in families.items():
            first, second = step_class(cpu, 0), step_class(cpu, 0)
            for index, t in enumerate(inputs):
                a, b = first.run(t), second.run(t)
                if not torch.equal(a[0], b[0]):
                    return Outcome(
                        FAILED, f"{family}: eager drafts not deterministic at step {index}"
                    )
                if not ((a[0] >= 0) & (a[0] < first.vocab)).all():
                    return Outcome(FAILED, f"{family}: draft ids out of range at step {index}")
            ran.append(f"{family} {len(inputs)} steps")
        return Outcome(
            SKIPPED,
            f"graph capture {NEEDS_CUDA}; the eager path ran on cpu ({', '.join(ran)})",
        )
    device = torch.device("cuda")
    for family, (step_class, inputs) in families.items():
        mismatch = graph_against_eager(lambda c=step_class: c(device, 0), inputs, device)
        if mismatch:
            return Outcome(FAILED, f"{family}: {mismatch}")
    counts = ", ".join(f"{family} {len(inputs)}" for family, (_, inputs) in families.items())
    return Outcome(PASSED, f"graph replay equals eager over ragged steps ({counts})")


# --- deferred host-to-device copies -------------------------------------------------------


def deferred_copy_run(fresh: bool, steps: int = 8, size: int = 1 << 16) -> list[int]:
    """Steps whose device data came out wrong when each step's host data is copied
    asynchronously on a side stream (queued behind a long kernel, so the copy really runs
    late) and consumed one step later, while the host already writes the next step's data:
    into a fresh pinned tensor per step, or into one reused pinned tensor."""
    import torch

    side = torch.cuda.Stream()
    reused = torch.empty(size, dtype=torch.int64, pin_memory=True)
    keep_alive, pending, wrong = [], None, []

    def consume(step: int, device_tensor, done) -> None:
        torch.cuda.current_stream().wait_event(done)
        if not bool((device_tensor == step).all()):
            wrong.append(step)

    for step in range(steps):
        host = torch.empty(size, dtype=torch.int64, pin_memory=True) if fresh else reused
        host.fill_(step)
        keep_alive.append(host)
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            device_tensor = host.to("cuda", non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        if pending is not None:
            consume(*pending)
        pending = (step, device_tensor, done)
    consume(*pending)
    torch.cuda.synchronize()
    return wrong


def check_deferred_copy(args: argparse.Namespace) -> Outcome:
    fresh_wrong = deferred_copy_run(fresh=True)
    reused_wrong = deferred_copy_run(fresh=False)
    facts = {"fresh_wrong_steps": fresh_wrong, "reused_wrong_steps": reused_wrong}
    if fresh_wrong:
        return Outcome(
            FAILED, f"fresh pinned tensors gave wrong data at steps {fresh_wrong}", facts
        )
    if not reused_wrong:
        return Outcome(
            PASSED,
            "fresh pinned tensors correct; the reused one was also correct, so the copies "
            "did not overlap the host write here (inconclusive control)",
            facts,
        )
    return Outcome(
        PASSED,
        f"fresh pinned tensors correct; the reused one was wrong at {len(reused_wrong)} of 8 "
        "steps (the control: the copies really ran late on this device)",
        facts,
    )


# --- rms_norm with a stacked weight -------------------------------------------------------


def check_rms_norm(args: argparse.Namespace) -> Outcome:
    import torch

    from vllm import _custom_ops as ops

    device = torch.device("cuda" if cuda_available() else "cpu")
    layers, contexts, heads, head_dim, eps = 4, 5, 2, 64, 1e-6
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(layers, contexts, heads, head_dim, generator=generator).to(
        device, torch.bfloat16
    )
    weight = (1 + torch.rand(layers, head_dim, generator=generator)).to(device, torch.bfloat16)
    stacked = torch.empty_like(x)
    ops.rms_norm(stacked, x, weight, eps)

    def loop(row_of_layer: Callable[[int], int]) -> torch.Tensor:
        out = torch.empty_like(x)
        for layer in range(layers):
            ops.rms_norm(
                out[layer], x[layer].contiguous(), weight[row_of_layer(layer)].contiguous(), eps
            )
        return out

    def close(a, b) -> bool:
        return torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)

    per_layer, row_zero = loop(lambda layer: layer), loop(lambda layer: 0)
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    reference = normed * weight.float().view(layers, 1, 1, head_dim)
    if not close(per_layer, reference):
        return Outcome(FAILED, f"{device.type}: rms_norm differs from RMSNorm even per layer")
    if close(stacked, per_layer):
        fact = f"{device.type}: stacked weight indexed by row"
    elif close(stacked, row_zero):
        fact = f"{device.type}: stacked weight not indexed by row (row 0 for every layer)"
    else:
        return Outcome(
            FAILED, f"{device.type}: stacked rms_norm matches neither a per-layer loop nor row 0"
        )
    return Outcome(PASSED, f"contract fact: {fact}", {"contract": fact})


# --- draft state ----------------------------------------------------------------------------


def check_draft_state(args: argparse.Namespace) -> Outcome:
    import torch

    from vllm.v1.spec_decode.dspark.ring import ContextRing

    device = torch.device("cuda" if cuda_available() else "cpu")
    geometry = V4_FLASH_RING
    num_slots, entries = args.max_num_seqs + 1, (args.max_num_seqs + 1) * geometry["window"] + 1
    # values (bf16), int64 tags and int64 write-scratch ranks, one hidden dump entry each
    expected = entries * (geometry["stages"] * geometry["head_dim"] * 2 + 8 + 8)
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    ring = ContextRing(
        num_slots,
        geometry["window"],
        (geometry["stages"], geometry["head_dim"]),
        torch.bfloat16,
        device,
    )
    buffers = (ring._flat_values, ring._flat_tags, ring._winner_rank)
    counted = sum(t.numel() * t.element_size() for t in buffers)
    facts = {"max_num_seqs": args.max_num_seqs, "bytes": counted, "expected": expected}
    if device.type == "cuda":
        facts["allocated"] = torch.cuda.memory_allocated() - before
    if counted != expected:
        return Outcome(FAILED, f"ring holds {counted} bytes, its geometry gives {expected}", facts)
    return Outcome(
        PASSED,
        f"DeepSeek-V4 ring at max_num_seqs {args.max_num_seqs}: {counted:,d} bytes "
        f"({counted / 2**20:.2f} MiB) on {device.type}, independent of max_model_len",
        facts,
    )


# --- driver ---------------------------------------------------------------------------------

CHECKS = (
    Check("device", "cuda", check_device, cuda_only=True),
    Check("architectures", "cuda (or --arch)", check_architectures),
    Check("ring", "cpu; cuda for the device comparison", check_ring),
    Check("draft_graphs", "cuda for graph capture; cpu runs the eager path", check_draft_graphs),
    Check("deferred_copy", "cuda", check_deferred_copy, cuda_only=True),
    Check("rms_norm", "vllm._C (cpu or cuda)", check_rms_norm),
    Check("draft_state", "cpu or cuda", check_draft_state),
)


def run_checks(args: argparse.Namespace) -> list[dict]:
    has_cuda = cuda_available()
    results = []
    for check in CHECKS:
        if check.cuda_only and not has_cuda:
            outcome = Outcome(SKIPPED, NEEDS_CUDA)
        elif check.name == "architectures" and not has_cuda and not args.arch:
            outcome = Outcome(SKIPPED, f"{NEEDS_CUDA} (or --arch sm_XY)")
        else:
            try:
                # vLLM logs to stdout; the report owns it.
                with contextlib.redirect_stdout(sys.stderr):
                    outcome = check.run(args)
            except Exception as e:
                outcome = Outcome(
                    FAILED, f"{type(e).__name__}: {e}", {"traceback": traceback.format_exc()}
                )
        results.append(
            {
                "name": check.name,
                "needs": check.needs,
                "status": outcome.status,
                "detail": outcome.detail,
                "facts": outcome.facts,
            }
        )
    return results


def verdict(results: list[dict]) -> str:
    failed = [r["name"] for r in results if r["status"] == FAILED]
    passed = sum(r["status"] == PASSED for r in results)
    skipped = sum(r["status"] == SKIPPED for r in results)
    if failed:
        return f"FAILED: {', '.join(failed)} ({passed} passed, {skipped} skipped)"
    return f"ok: {passed} passed, {skipped} skipped"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--arch", help="check the binaries against this architecture (sm_121)")
    parser.add_argument(
        "--max-num-seqs", type=int, default=SPARK_MAX_NUM_SEQS, help="for the draft-state bytes"
    )
    args = parser.parse_args(argv)
    results = run_checks(args)
    report = {
        "ok": not any(r["status"] == FAILED for r in results),
        "verdict": verdict(results),
        "checks": results,
    }
    if args.json:
        print(json.dumps(report))
    else:
        for r in results:
            print(f"{r['status']:>7}  {r['name']:<14} {r['detail']}")
        print(report["verdict"])
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
