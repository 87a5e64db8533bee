# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Confidence-scheduled draft lengths for DSpark (docs/confidence-scheduling.md).

`off` verifies all `k` drafts. `threshold` is DeepSpec's rule (`_confident_prefix_length` in
`deepspec/eval/dspark/draft_ops.py`), for which its confidence heads are trained: truncate at the
first position whose confidence is below `tau`. The lengths are a pure function of the
confidences, so every tensor-parallel rank would compute the same ones.
"""

from dataclasses import dataclass
from typing import Literal, get_args

import torch

SchedulerName = Literal["off", "threshold"]
SCHEDULERS: tuple[str, ...] = get_args(SchedulerName)


@dataclass(frozen=True)
class ConfidenceScheduleConfig:
    """The ``dspark_confidence_*`` fields. ``threshold`` is required by the ``threshold`` rule and
    refused with ``off``, so a setting never silently has no effect."""

    scheduler: SchedulerName = "off"
    threshold: float | None = None
    """`tau`, a probability in [0, 1]."""

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ValueError(
                f"dspark_confidence_scheduler={self.scheduler!r} is not supported: "
                f"expected one of {SCHEDULERS}."
            )
        if self.scheduler == "threshold" and self.threshold is None:
            raise ValueError(
                "dspark_confidence_scheduler='threshold' needs dspark_confidence_threshold, "
                "e.g. 0.3."
            )
        if self.scheduler == "off" and self.threshold is not None:
            raise ValueError(
                "dspark_confidence_threshold only applies with dspark_confidence_scheduler="
                "'threshold', but the scheduler is 'off': remove it, or set "
                "dspark_confidence_scheduler='threshold'."
            )
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(
                f"dspark_confidence_threshold={self.threshold!r} is not a number in [0, 1]."
            )

    @property
    def needs_confidence(self) -> bool:
        """Whether the proposer must run the confidence head for `schedule_lengths`."""
        return self.scheduler != "off"


def threshold_lengths(conf: torch.Tensor, tau: float) -> torch.Tensor:
    """The positions before the first confidence `< tau`, int32 [num_reqs], without a host sync."""
    return (conf >= tau).to(torch.int32).cumprod(dim=1).sum(dim=1, dtype=torch.int32)


def schedule_lengths(conf: torch.Tensor, config: ConfidenceScheduleConfig, k: int) -> torch.Tensor:
    """Draft lengths in [0, k] for this step from `conf` [num_reqs, k], int32 [num_reqs]."""
    if conf.dim() != 2 or not conf.is_floating_point() or conf.shape[1] != k:
        raise ValueError(
            f"confidence must be a float tensor [num_reqs, k = {k}], got {conf.dtype} "
            f"{list(conf.shape)}."
        )
    if config.scheduler == "off":
        return torch.full((conf.shape[0],), k, dtype=torch.int32, device=conf.device)
    assert config.threshold is not None
    return threshold_lengths(conf, config.threshold)
