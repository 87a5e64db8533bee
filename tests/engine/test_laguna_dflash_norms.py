# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Upstream Laguna DFlash drafts, installed through this project, normalise each draft layer's
context with that layer's own weights (the ``laguna-dflash`` patch).

``DFlashLagunaModel`` stacks every layer's ``input_layernorm`` and ``k_norm`` weight and calls
``ops.rms_norm`` once over all layers, which on CPU applies row 0 to every layer. The patched
``_project_context_kv`` and ``_normalize_context_k`` of vLLM's own module run here, on vLLM's own
CPU ``rms_norm``, against a plain per-layer recompute; the fused call, taken by forcing the CUDA
branch, is the control that must fail.
"""

import types

import pytest
import torch

from vllm.model_executor.models.laguna_dflash import DFlashLagunaModel
from vllm.platforms import current_platform

LAYERS, CONTEXT, HIDDEN, KV_HEADS, HEAD_DIM, EPS = 3, 5, 64, 2, 16, 1e-6


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


@pytest.fixture
def draft() -> types.SimpleNamespace:
    """The stacked tensors ``DFlashLagunaModel`` builds, with per-layer, non-unit norms."""
    g = torch.Generator().manual_seed(0)
    return types.SimpleNamespace(
        _input_layernorm_weights=1 + 0.5 * torch.randn(LAYERS, HIDDEN, generator=g),
        _k_norm_weights=1 + 0.5 * torch.randn(LAYERS, HEAD_DIM, generator=g),
        _kv_weights=torch.randn(LAYERS, 2 * KV_HEADS * HEAD_DIM, HIDDEN, generator=g) / 8,
        _kv_biases=None,
        _rms_norm_eps=EPS,
    )


def context_keys(draft) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's context K path: projected keys, then their K-norm ([L, ctx, kv, hd] each)."""
    context = torch.randn(CONTEXT, HIDDEN, generator=torch.Generator().manual_seed(1))
    keys, _ = DFlashLagunaModel._project_context_kv(
        draft, context, CONTEXT, LAYERS, KV_HEADS, HEAD_DIM
    )
    normed = DFlashLagunaModel._normalize_context_k(draft, keys)
    expected = []
    for layer in range(LAYERS):
        hidden = rms_norm(context, draft._input_layernorm_weights[layer])
        kv = (hidden @ draft._kv_weights[layer].T).view(CONTEXT, 2, KV_HEADS, HEAD_DIM)
        expected.append(rms_norm(kv[:, 0], draft._k_norm_weights[layer]))
    return normed, torch.stack(expected)


def test_each_layer_gets_its_own_input_norm_and_k_norm(draft):
    normed, expected = context_keys(draft)
    torch.testing.assert_close(normed, expected, rtol=1e-4, atol=1e-4)


def test_control_the_fused_call_uses_layer_0s_weights_on_cpu(draft, monkeypatch):
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    normed, expected = context_keys(draft)
    torch.testing.assert_close(normed[0], expected[0], rtol=1e-4, atol=1e-4)
    for layer in range(1, LAYERS):
        assert not torch.allclose(normed[layer], expected[layer], rtol=1e-2, atol=1e-2)
