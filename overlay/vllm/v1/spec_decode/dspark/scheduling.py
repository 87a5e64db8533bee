"""Confidence-scheduled draft lengths for DSpark.

DSpark's confidence head predicts `c[b, j]`, the probability that draft position `j` of request `b`
is accepted given that positions `0..j-1` were. The survival `S[b, j] = c[b, 0] * ... * c[b, j]` is
then the probability that position `j` is reached and accepted. The schedulers here turn
confidences into per-request draft lengths, so the target verifies only the drafts likely to pay:

- `off` (default): every request verifies all `k` drafts; no confidence is needed.
- `threshold`: DeepSpec's rule (`deepspec/eval/dspark/draft_ops.py`, `_confident_prefix_length`):
  truncate at the first position whose confidence is below `tau`. The confidence heads DeepSpec
  trains are calibrated for this rule.
- `survival_threshold`: the longest prefix whose survivals all stay at or above `tau` (stricter:
  with the same `tau` it never verifies more than `threshold`).
- `hardware`: admit draft slots in order of falling survival while the expected tokens per
  second `E * f(batch_tokens)` grows, where `E = B + sum of admitted survivals` counts the accepted
  drafts plus one bonus (or correction) token per request and `f` is the measured step rate.

Optimality of `hardware`: for a fixed number `T` of verified drafts the `T` largest survivals give
the largest `E`, and they always form a prefix of every request, since survival never grows along a
request (a product of factors in `[0, 1]`, also in floating point) and ties are broken by `(b, j)`.
Scanning all `T` therefore finds the optimum whenever `f` does not grow with the batch (a slower
or equal step for more tokens, as real step curves are); with `hardware_early_stop` (the default)
the scan stops at the first `T` that does not improve, which is optimal only while `E(T) * f(T)` is
unimodal and may stop early at a step of `f`. `tests/dspark/test_scheduling.py` checks both claims
against exhaustive search and records cases where the early stop loses.

Determinism across tensor-parallel ranks (vLLM issue 56831: ranks that disagree on lengths run
different verify shapes and deadlock in collectives). Two layers make the lengths agree:

1. These functions are pure: the result depends only on `(conf, config, k)`. Survival is a fixed
   left-to-right product of correctly rounded IEEE multiplications, computed per column, so its
   bits do not depend on thread count, batch order, or device kind; the `hardware` ranking is a
   stable sort over the row-major slot index, so ties go to the lower `(b, j)`; nothing is random,
   and the only floating-point reduction is one `cumsum` over the sorted survivals, deterministic
   for a given device kind and library build (the other reductions count integers).
2. In vLLM's V1 engine the lengths only take effect through the engine-core scheduler: the draft
   lists are read back from a single worker (TP rank 0 of the last pipeline stage) and the
   scheduler sends the same per-request draft counts to every rank in `SchedulerOutput`
   (confidence scheduling is refused with async scheduling, see `options.py`). A rank never
   truncates its own verify rows, so even confidences that differ in the last bit across ranks
   cannot make the shapes diverge.
"""

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

SchedulerName = Literal["off", "threshold", "survival_threshold", "hardware"]
SCHEDULERS: tuple[str, ...] = get_args(SchedulerName)

_THRESHOLD_SCHEDULERS = ("threshold", "survival_threshold")
_CURVE_POINT = re.compile(r"^\s*(\d+)\s*:\s*([^:,\s]+)\s*$")


def _option_error(key: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"dspark_{key} = {value!r} is invalid: expected {allowed}.")


@dataclass(frozen=True)
class StepRateCurve:
    """Target steps per second as a step function of the tokens in the batch.

    The rate for `n` tokens is the rate of the largest point at or below `n`; below the first point
    it is the first point's rate. Points are sorted by tokens and have unique token counts.
    """

    points: tuple[tuple[int, float], ...]
    _device_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        _check_curve_points(self.points, shown=self.points)

    @classmethod
    def parse(cls, spec: "str | Mapping[Any, Any] | StepRateCurve") -> "StepRateCurve":
        """Reads `"1:40,8:35,32:20"` or `{1: 40, "8": 35}` (batch tokens -> steps per second)."""
        if isinstance(spec, StepRateCurve):
            return spec
        allowed = "a mapping or a string like '1:40,8:35,32:20' (batch tokens: steps/s, rate > 0)"
        if isinstance(spec, str):
            matches = [_CURVE_POINT.match(part) for part in spec.split(",")]
            if not spec.strip() or not all(matches):
                raise _option_error("step_rate_curve", spec, allowed)
            raw = [(m.group(1), m.group(2)) for m in matches if m]
        elif isinstance(spec, Mapping):
            raw = list(spec.items())
        else:
            raise _option_error("step_rate_curve", spec, allowed)
        points: dict[int, float] = {}
        for tokens, rate in raw:
            try:
                n = _strict_int(tokens)
                r = _strict_float(rate)
            except (TypeError, ValueError):
                raise _option_error("step_rate_curve", spec, allowed) from None
            if n in points:
                raise _option_error("step_rate_curve", spec, f"each token count once ({n} repeats)")
            points[n] = r
        sorted_points = tuple(sorted(points.items()))
        _check_curve_points(sorted_points, shown=spec)
        return cls(sorted_points)

    def rate(self, num_tokens: int) -> float:
        rate = self.points[0][1]
        for n, r in self.points:
            if n > num_tokens:
                break
            rate = r
        return rate

    def rates(self, num_tokens: torch.Tensor) -> torch.Tensor:
        """Vectorised `rate` (float64) for a tensor of token counts, on that tensor's device."""
        tokens, rates = self._tables(num_tokens.device)
        index = torch.searchsorted(tokens, num_tokens, right=True) - 1
        return rates[index.clamp_(min=0)]

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # Built once per device, so the step path does not copy the curve to the device.
        if device not in self._device_tables:
            tokens = torch.tensor([n for n, _ in self.points], dtype=torch.int64, device=device)
            rates = torch.tensor([r for _, r in self.points], dtype=torch.float64, device=device)
            self._device_tables[device] = (tokens, rates)
        return self._device_tables[device]


def _check_curve_points(points: tuple[tuple[int, float], ...], shown: object) -> None:
    if not points:
        raise _option_error("step_rate_curve", shown, "at least one 'tokens:rate' point")
    tokens = [n for n, _ in points]
    if tokens != sorted(set(tokens)):
        raise _option_error("step_rate_curve", shown, "points sorted by tokens, each once")
    for n, rate in points:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise _option_error("step_rate_curve", shown, "token counts >= 1")
        if not math.isfinite(rate) or rate <= 0:
            raise _option_error("step_rate_curve", shown, "finite rates > 0 (steps per second)")


def _require_only_with(
    key: str, present: bool, owners: tuple[str, ...], scheduler: str, example: str
) -> None:
    """Rejects an option that is missing for its schedulers or set for another one."""
    names = " or ".join(repr(owner) for owner in owners)
    if present and scheduler not in owners:
        raise ValueError(
            f"dspark_{key} only applies with dspark_confidence_scheduler={names}, but the "
            f"scheduler is {scheduler!r}: remove it, or set dspark_confidence_scheduler={names}."
        )
    if not present and scheduler in owners:
        raise ValueError(
            f"dspark_confidence_scheduler={scheduler!r} needs dspark_{key}, e.g. {example}."
        )


def _strict_int(value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(value)
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    raise TypeError(value)


def _strict_float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(value)
    return float(value)


@dataclass(frozen=True)
class ConfidenceScheduleConfig:
    """Which confidence scheduler picks the draft lengths, with its settings.

    Options that do not apply to the chosen scheduler are rejected rather than ignored, so a
    setting never silently has no effect.
    """

    scheduler: SchedulerName = "off"
    threshold: float | None = None
    """`tau` of the threshold schedulers, a probability in [0, 1]; required by them."""
    step_rate_curve: StepRateCurve | None = None
    """Steps per second by batch tokens for the `hardware` scheduler; required by it."""
    early_stop: bool = True
    """`hardware` stops at the first admission that does not raise the expected throughput."""

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise _option_error("confidence_scheduler", self.scheduler, f"one of {SCHEDULERS}")
        _require_only_with(
            "confidence_threshold",
            self.threshold is not None,
            _THRESHOLD_SCHEDULERS,
            self.scheduler,
            "0.3",
        )
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise _option_error("confidence_threshold", self.threshold, "a number in [0, 1]")
        _require_only_with(
            "step_rate_curve",
            self.step_rate_curve is not None,
            ("hardware",),
            self.scheduler,
            "'1:40,8:35,32:20' (batch tokens: target steps per second)",
        )
        if not isinstance(self.early_stop, bool):
            raise _option_error("hardware_early_stop", self.early_stop, "true or false")

    @property
    def needs_confidence(self) -> bool:
        """Whether the proposer must run the confidence head for `schedule_lengths`."""
        return self.scheduler != "off"

    @classmethod
    def from_fields(
        cls,
        scheduler: str = "off",
        threshold: float | None = None,
        step_rate_curve: "str | Mapping[Any, Any] | StepRateCurve | None" = None,
        early_stop: bool | None = None,
    ) -> "ConfidenceScheduleConfig":
        """From the ``dspark_confidence_*`` speculative-config fields; ``early_stop``
        None means unset (it may only be set for ``hardware``)."""
        if early_stop is not None:
            _require_only_with("hardware_early_stop", True, ("hardware",), scheduler, "false")
        return cls(
            scheduler=scheduler,  # type: ignore[arg-type]
            threshold=threshold,
            step_rate_curve=None
            if step_rate_curve is None
            else StepRateCurve.parse(step_rate_curve),
            early_stop=True if early_stop is None else early_stop,
        )


def _check_confidence(conf: torch.Tensor, k: int | None = None) -> None:
    if conf.dim() != 2 or not conf.is_floating_point():
        raise ValueError(
            f"confidence must be a float tensor [num_reqs, k], got {conf.dtype} {list(conf.shape)}."
        )
    if k is not None and conf.shape[1] != k:
        raise ValueError(f"confidence has {conf.shape[1]} positions, expected k = {k}.")


def survival(conf: torch.Tensor) -> torch.Tensor:
    """`S[b, j] = conf[b, 0] * ... * conf[b, j]`, multiplied left to right.

    Confidences must lie in [0, 1] (the confidence head ends in a sigmoid); they are not checked
    here because that would need a device-to-host sync every step.
    """
    _check_confidence(conf)
    if conf.shape[1] == 0:
        return conf.clone()
    columns = [conf[:, 0]]
    for j in range(1, conf.shape[1]):
        columns.append(columns[-1] * conf[:, j])
    return torch.stack(columns, dim=1)


def _leading_true(keep: torch.Tensor) -> torch.Tensor:
    return keep.to(torch.int32).cumprod(dim=1).sum(dim=1, dtype=torch.int32)


def threshold_lengths(conf: torch.Tensor, tau: float) -> torch.Tensor:
    """DeepSpec's rule: the positions before the first confidence `< tau`, int32 [num_reqs]."""
    _check_confidence(conf)
    return _leading_true(conf >= tau)


def survival_threshold_lengths(conf: torch.Tensor, tau: float) -> torch.Tensor:
    """Longest prefix with every survival `>= tau`, as int32 [num_reqs] on `conf`'s device."""
    return _leading_true(survival(conf) >= tau)


def hardware_lengths(
    conf: torch.Tensor, curve: StepRateCurve, early_stop: bool = True
) -> torch.Tensor:
    """Greedy admission by survival maximising `E * f(batch_tokens)`; int32 [num_reqs].

    Runs on `conf`'s device without a host sync. Slots of zero survival are never admitted.
    """
    num_reqs = conf.shape[0]
    surv = survival(conf).reshape(-1).to(torch.float64)
    # Stable sort: equal survivals keep row-major order, i.e. the lower (b, j) is admitted first.
    ranked, order = torch.sort(surv, descending=True, stable=True)
    num_admitted = torch.arange(ranked.numel() + 1, device=conf.device)
    expected = num_reqs + torch.cat([ranked.new_zeros(1), ranked.cumsum(dim=0)])
    value = expected * curve.rates(num_reqs + num_admitted)
    num_positive = (ranked > 0).sum()
    value = value.masked_fill(num_admitted > num_positive, -math.inf)
    if early_stop:
        improves = value[1:] > value[:-1]
        best = improves.to(torch.int64).cumprod(dim=0).sum()
    else:
        best = value.argmax()  # The first maximum: the fewest tokens for the same throughput.
    rank = torch.empty_like(order)
    rank[order] = num_admitted[:-1]
    admitted = (rank < best).reshape(conf.shape)
    return admitted.sum(dim=1, dtype=torch.int32).reshape(num_reqs)


def schedule_lengths(
    conf: torch.Tensor | None,
    config: ConfidenceScheduleConfig,
    k: int,
    *,
    num_reqs: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Draft lengths in [0, k] for this step, int32 [num_reqs].

    `conf` may be None only for `off` (then `num_reqs` and `device` size the result); every other
    scheduler needs `conf` of shape [num_reqs, k].
    """
    if config.scheduler == "off":
        if conf is not None:
            _check_confidence(conf, k)
            num_reqs, device = conf.shape[0], conf.device
        if num_reqs is None:
            raise ValueError("schedule_lengths needs num_reqs when conf is None.")
        return torch.full((num_reqs,), k, dtype=torch.int32, device=device)
    if conf is None:
        raise ValueError(f"dspark_confidence_scheduler={config.scheduler!r} needs confidences.")
    _check_confidence(conf, k)
    if config.scheduler == "threshold":
        assert config.threshold is not None
        return threshold_lengths(conf, config.threshold)
    if config.scheduler == "survival_threshold":
        assert config.threshold is not None
        return survival_threshold_lengths(conf, config.threshold)
    assert config.step_rate_curve is not None
    return hardware_lengths(conf, config.step_rate_curve, config.early_stop)
