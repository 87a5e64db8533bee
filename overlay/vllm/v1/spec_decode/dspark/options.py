"""``speculative_config.dspark_options``: the V1 DSpark proposer's settings.

Options travel inside the speculative config (a field added by this project's
patch) rather than in environment variables, because vLLM only warns about
unknown ``VLLM_*`` variables and a misspelt knob would silently do nothing.
Every key is validated when the proposer starts.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.spec_decode.dspark.scheduling import SCHEDULING_KEYS, ConfidenceScheduleConfig

_PROPOSER_KEYS = ("window", "draft_log")


@dataclass(frozen=True)
class DSparkOptions:
    window: int | None = None
    """Ring window W for drafts whose layers attend to the full prefix. Unset:
    the model's max length, so the draft sees exactly the full context."""
    draft_log: str | None = None
    """Debug only: append every step's drafts per request to this JSONL file.
    Costs a device-to-host copy per step."""
    scheduling: ConfidenceScheduleConfig = field(default_factory=ConfidenceScheduleConfig)
    """Confidence-scheduled verification (off by default)."""

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> "DSparkOptions":
        known = (*_PROPOSER_KEYS, *SCHEDULING_KEYS)
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(
                f"Unknown dspark_options key(s) {unknown}; supported keys: {list(known)}."
            )
        window = options.get("window")
        if window is not None and (
            isinstance(window, bool) or not isinstance(window, int) or window < 1
        ):
            raise ValueError(f"dspark_options.window must be a positive integer, got {window!r}.")
        draft_log = options.get("draft_log")
        if draft_log is not None and not (isinstance(draft_log, str) and draft_log):
            raise ValueError(f"dspark_options.draft_log must be a file path, got {draft_log!r}.")
        return cls(
            window=window,
            draft_log=draft_log,
            scheduling=ConfidenceScheduleConfig.from_options(options),
        )
