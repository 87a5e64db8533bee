# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Lanes: which vLLM model runner serves DSpark, from the same image and profile.

`v1`: this project's DSpark proposers on vLLM's V1 model runner (installed by install.py).
`v2`: upstream vLLM's own DSpark on Model Runner V2, which needs no install and which the
installed patches leave as stock vLLM has it. The site file picks the lane; the profile says
which lanes it serves and what the V2 lane adds (docs/lanes.md).
"""

from __future__ import annotations

from collections.abc import Iterable

V1, V2 = "v1", "v2"
LANES = (V1, V2)
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"

# vLLM 0.33.0 verifies adaptively only where every attention backend can take query lengths
# from the device: DeepSeek-V4's indexer needs DeepGEMM's varlen paged MQA logits (SM100
# family; SM90 flattens) and FlashInfer its trtllm-gen decode (SM100 family); FlashAttention 2
# cannot replay variable-length decode graphs. The Blackwell targets with all of them: 10.x.
ADAPTIVE_VERIFICATION_MAJOR = 10


def runner_env(lane: str) -> dict[str, str]:
    """The environment that selects the lane's model runner in vLLM."""
    return {RUNNER_ENV: "1" if lane == V2 else "0"}


def runner_args(lane: str) -> list[str]:
    """What tells preflight's dry start and GPU self-test which lane to check."""
    return ["--runner", lane]


def adaptive_verification_problem(compute_capabilities: Iterable[str]) -> str | None:
    """Why vLLM cannot verify adaptively on these targets, or None when it can."""
    capabilities = list(compute_capabilities)
    if not capabilities:
        return 'needs compute_capability, the targets\' compute capabilities (e.g. ["10.0"])'
    refused = [cc for cc in capabilities if int(cc.split(".")[0]) != ADAPTIVE_VERIFICATION_MAJOR]
    if refused:
        return (
            f"of the images' targets, vLLM 0.33.0 verifies adaptively on compute capability "
            f"10.x (B200, B300) only, not on {', '.join(refused)}; set it to false"
        )
    return None
