# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""What every check returns, and the few facts about this host the checks share."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
NEEDS_CUDA = "needs CUDA"


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
    v1_only: bool = False
    """Checks this project's V1 proposers; skipped for `--runner v2`, which serves upstream's."""


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
