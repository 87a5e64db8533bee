# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""What preflight checks in the image for the compilers a start runs: each need passes where
the node has it and fails (the control) where it lacks it, on this host's real PATH and
directories."""

from __future__ import annotations

import pytest

from tools.dry_start import warmup
from tools.dry_start.engine import Refused, refusal

STEPS = [warmup.Step("graphs", "capture 5 target FULL graphs", warmup.INDUCTOR)]


@pytest.fixture
def no_nvcc(monkeypatch, tmp_path):
    """A node whose image has no CUDA compiler and no C compiler."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setattr(warmup, "find_nvcc", lambda: None)


def test_a_node_with_what_the_steps_need_passes(tmp_path):
    env = {"TRITON_CACHE_DIR": str(tmp_path / "triton"), "CC": "sh"}  # any program on PATH
    assert list(warmup.missing_needs(STEPS, set(), env)) == []


def test_deep_gemm_without_a_compiler_is_named(no_nvcc):
    (problem,) = warmup.missing_needs([], {"DeepGEMM"}, {})
    assert problem.startswith("DeepGEMM compiles its kernels at first use")
    assert list(warmup.missing_needs([], {"DeepGEMM"}, {"DG_JIT_USE_NVRTC": "1"})) == []
    assert list(warmup.missing_needs([], set(), {})) == []  # DeepGEMM not launched: not needed


def test_flashinfer_on_an_offline_node_without_cubins_or_compiler(no_nvcc):
    assert list(warmup.missing_needs([], {"FlashInfer"}, {})) == []  # online: it downloads
    (problem,) = warmup.missing_needs([], {"FlashInfer"}, {"HF_HUB_OFFLINE": "1"})
    assert "offline (HF_HUB_OFFLINE=1)" in problem


def test_triton_without_a_c_compiler(no_nvcc):
    (problem,) = warmup.missing_needs(STEPS, set(), {})
    assert "host C compiler" in problem


def test_an_unwritable_jit_cache(tmp_path):
    """A cache path under a file: no process can make that directory (root included)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {"CC": "sh", "DG_JIT_CACHE_DIR": str(blocker / "deep-gemm")}
    (problem,) = warmup.missing_needs([], set(), env)
    assert problem.startswith(f"DG_JIT_CACHE_DIR={blocker / 'deep-gemm'} is not writable")
    assert list(warmup.missing_needs([], set(), {**env, "DG_JIT_CACHE_DIR": str(tmp_path)})) == []


def test_a_missing_need_is_refused_with_the_fix():
    found = refusal(Refused("warm-up", warmup.MissingNeeds("DeepGEMM ... finds no nvcc")))
    assert (found.step, found.fix) == ("warm-up", warmup.MissingNeeds.fix)
