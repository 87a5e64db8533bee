# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Memory of the DeepSeek-V4-Flash DSpark draft: as vLLM loads it vs as the checkpoint ships it.

Builds the draft exactly as the proposer does (vLLM's DeepSeek-V4 MoE, quantised linears and
mHC parameters) for the published DeepSeek-V4-Flash config on the meta device, so no weights are
read or allocated, and sums its parameters' bytes. Next to it: the bytes of the checkpoint's
``mtp.*`` tensors in their shipped formats (FP8 e4m3 linears with one ue8m0 scale per 128x128
block, MXFP4 routed experts with one ue8m0 scale per 32 values, bf16 norms and heads, fp32 mHC),
and the proposer's ring at max_num_seqs 16 and 256.

Then the GPU-side draft state the proposer allocates besides its weights (ring, block buffers,
CUDA-graph input buffers, the probabilistic drafts' distributions), built by the proposer's own
constructors on the meta device, at the DGX Spark profile's sizes (max_num_seqs 6, k = 5,
DeepSeek-V4's vocabulary, probabilistic drafts) and at max_num_seqs 1024, k = 7, V = 151936
(Qwen3's vocabulary; the distributions buffer is the same for Qwen3 drafts, the ring is the V4
draft's). Each of these is allocated before vLLM's memory profile, so the profile
counts it; the profile run (the proposer's ``dummy_run``) also writes the context of
max_num_batched_tokens target rows and every distribution row. Next to the distributions: the
peak the Markov chain had before, k ``[B, V]`` tensors plus their stack.

On a CPU without AMX, vLLM picks no FP8-block linear kernel and no MXFP4 MoE backend; the script
then accepts vLLM's CPU FP8 kernel class and the Triton MXFP4 backend for construction only
(parameters are created by the quantisation methods themselves; no kernel runs on meta tensors).

    python -m benchmarks.deepseek_v4_memory
"""

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch

from dspark_fixtures.deepseek_v4_flash import FP8_BLOCK, MXFP4_GROUP, V4_FLASH_CONFIG

GIB = 2**30


def checkpoint_mtp_bytes(config: dict) -> int:
    """Bytes of every ``mtp.*`` tensor in the format DeepSeek-V4-Flash ships it."""
    from vllm.v1.spec_decode.dspark.deepseek_v4 import DeepSeekV4DSparkConfig, expected_draft_names

    c = DeepSeekV4DSparkConfig.from_hf_config(config)
    H, D, heads, groups = c.hidden_size, c.head_dim, c.num_attention_heads, c.o_groups
    inter, shared = c.moe_intermediate_size, c.moe_intermediate_size * c.n_shared_experts
    n, V, r = c.hc_mult, c.vocab_size, c.dspark_markov_rank
    fp8 = {  # name -> (out, in)
        "attn.wq_a.weight": (c.q_lora_rank, H),
        "attn.wq_b.weight": (heads * D, c.q_lora_rank),
        "attn.wkv.weight": (D, H),
        "attn.wo_a.weight": (groups * c.o_lora_rank, heads // groups * D),
        "attn.wo_b.weight": (H, groups * c.o_lora_rank),
        "ffn.shared_experts.w1.weight": (shared, H),
        "ffn.shared_experts.w3.weight": (shared, H),
        "ffn.shared_experts.w2.weight": (H, shared),
        "main_proj.weight": (H, c.num_stages * H),
    }
    fp4 = {"w1": (inter, H), "w3": (inter, H), "w2": (H, inter)}
    plain = {  # name -> (elements, bytes per element)
        "attn.q_norm.weight": (c.q_lora_rank, 2),
        "attn.kv_norm.weight": (D, 2),
        "attn.attn_sink": (heads, 4),
        "attn_norm.weight": (H, 2),
        "ffn_norm.weight": (H, 2),
        "main_norm.weight": (H, 2),
        "norm.weight": (H, 2),
        "ffn.gate.weight": (c.n_routed_experts * H, 2),
        "ffn.gate.bias": (c.n_routed_experts, 4),
        "hc_attn_fn": ((2 + n) * n * n * H, 4),
        "hc_ffn_fn": ((2 + n) * n * n * H, 4),
        "hc_attn_base": ((2 + n) * n, 4),
        "hc_ffn_base": ((2 + n) * n, 4),
        "hc_attn_scale": (3, 4),
        "hc_ffn_scale": (3, 4),
        "hc_head_fn": (n * n * H, 4),
        "hc_head_base": (n, 4),
        "hc_head_scale": (1, 4),
        "markov_head.markov_w1.weight": (V * r, 2),
        "markov_head.markov_w2.weight": (V * r, 2),
        "confidence_head.proj.weight": (H + r, 2),
    }
    total = 0
    for name in expected_draft_names(c, with_confidence=True):
        rest = name.split(".", 2)[2]
        if rest in fp8:
            out, inp = fp8[rest]
            total += out * inp + math.ceil(out / FP8_BLOCK) * math.ceil(inp / FP8_BLOCK)
        elif ".experts." in rest:
            out, inp = fp4[rest.split(".")[3]]
            total += out * inp // 2 + out * inp // MXFP4_GROUP
        else:
            elements, size = plain[rest]
            total += elements * size
    return total


def loaded_draft_bytes(config: dict) -> int:
    """Parameter bytes of the draft as the proposer builds it, on the meta device."""
    import vllm.model_executor.kernels.linear as linear_kernels
    import vllm.model_executor.layers.quantization.mxfp4 as mxfp4
    from dspark_fixtures.v4_draft import build_draft, v4_vllm_config
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        linear_kernels.is_supported_and_can_implement_kernel = lambda *args, **kwargs: (True, None)
        mxfp4.select_deepseek_v4_mxfp4_moe_backend = lambda moe_config: (
            Mxfp4MoeBackend.TRITON_UNFUSED,
            None,
        )
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(config))
        vllm_config = v4_vllm_config(Path(model_dir), k=config["dspark_block_size"])
        model = build_draft(vllm_config, device="meta")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def ring_bytes(config: dict, max_num_seqs: int) -> int:
    """The proposer's ring (values, tags and write scratch) for ``max_num_seqs`` slots + scratch."""
    from vllm.v1.spec_decode.dspark.ring import ContextRing

    ring = ContextRing(
        num_slots=max_num_seqs + 1,
        window=config["sliding_window"],
        entry_shape=(len(config["dspark_target_layer_ids"]), config["head_dim"]),
        dtype=torch.bfloat16,
        device=torch.device("meta"),
    )
    buffers = (ring._flat_values, ring._flat_tags, ring._winner_rank)
    return sum(t.numel() * t.element_size() for t in buffers)


def draft_state_bytes(config: dict, max_num_seqs: int, k: int, vocab_size: int) -> dict[str, int]:
    """Bytes of each GPU buffer of the ring proposer's draft state (weights aside), from the
    proposer's own constructors on the meta device."""
    from unittest import mock

    from vllm.v1.spec_decode.dspark import cudagraph
    from vllm.v1.spec_decode.dspark.drafter import BlockDrafter
    from vllm.v1.spec_decode.dspark.markov import draft_probs_buffer
    from vllm.v1.spec_decode.dspark.ring import ContextRing

    meta = torch.device("meta")
    ring = ContextRing(
        num_slots=max_num_seqs + 1,
        window=config["sliding_window"],
        entry_shape=(len(config["dspark_target_layer_ids"]), config["head_dim"]),
        dtype=torch.bfloat16,
        device=meta,
    )
    probs = draft_probs_buffer(max_num_seqs, k, vocab_size, meta)
    drafter = BlockDrafter(
        None, None, ring, noise_token_id=0, max_position=1, max_num_drafts=k, draft_probs=probs
    )
    # The wrapper holds no tensors before capture; the captured graphs' memory is measured by
    # vLLM's own CUDA-graph profile.
    with mock.patch.object(cudagraph, "CUDAGraphWrapper"):
        graphs = cudagraph.DraftGraphs(
            # The graphs' inputs are sized by the largest planned size: at most max_num_seqs.
            drafter,
            None,
            [max_num_seqs],
            k,
            with_confidence=False,
            sample_from_logits=mock.Mock(),
        )

    def size(*tensors: torch.Tensor) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    return {
        "V4 ring (values, tags, write scratch)": size(
            ring._flat_values, ring._flat_tags, ring._winner_rank
        ),
        "block ids, positions, offsets": size(
            drafter._block_ids, drafter._block_positions, drafter._block_offsets
        ),
        "graph inputs (slots, anchors, tokens, temperatures)": size(
            graphs._slots, graphs._anchors, graphs._anchor_tokens, graphs.sampler.temperature
        ),
        "draft distributions [B, k, V]": size(probs),
    }


def print_draft_state(label: str, max_num_seqs: int, k: int, vocab_size: int) -> None:
    state = draft_state_bytes(V4_FLASH_CONFIG, max_num_seqs, k, vocab_size)
    print(f"GPU draft state, {label}: max_num_seqs={max_num_seqs}, k={k}, V={vocab_size}")
    for name, nbytes in state.items():
        print(f"  {name:<38s}: {nbytes:>15,d}  ({nbytes / 2**20:.1f} MiB)")
    total = sum(state.values())
    print(f"  {'total, all counted by the profile':<38s}: {total:>15,d}  ({total / GIB:.2f} GiB)")
    probs = state["draft distributions [B, k, V]"]
    transient = max_num_seqs * vocab_size * 4
    before = 2 * probs
    now = probs + transient
    # From the shapes: before, k [B, V] tensors and their [B, k, V] stack; now, the buffer and
    # the one [B, V] distribution being written.
    print(f"  distributions at peak, before (shapes): {before:>15,d}  ({before / GIB:.2f} GiB)")
    print(f"  distributions at peak, now (shapes)   : {now:>15,d}  ({now / GIB:.2f} GiB)")
    print(f"  now / before                          : {now / before:.4f}")


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    shipped = checkpoint_mtp_bytes(V4_FLASH_CONFIG)
    loaded = loaded_draft_bytes(V4_FLASH_CONFIG)
    print("DeepSeek-V4-Flash DSpark draft (3 stages), bytes")
    print(f"  checkpoint mtp.* as shipped : {shipped:>15,d}  ({shipped / GIB:.2f} GiB)")
    print(f"  draft as loaded by vLLM     : {loaded:>15,d}  ({loaded / GIB:.2f} GiB)")
    print(f"  loaded / shipped            : {loaded / shipped:.4f}")
    for max_num_seqs in (16, 256):
        size = ring_bytes(V4_FLASH_CONFIG, max_num_seqs)
        label = f"ring, max_num_seqs={max_num_seqs}"
        print(f"  {label:<28s}: {size:>15,d}  ({size / 2**20:.1f} MiB)")
    print_draft_state("DGX Spark profile", 6, 5, V4_FLASH_CONFIG["vocab_size"])
    print_draft_state("large GPU", 1024, 7, 151936)


if __name__ == "__main__":
    main()
