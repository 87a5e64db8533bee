# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""vLLM's closest flag to each one its `vllm serve` parser did not recognise.

Standard library only: the launcher's serving-flags check (shipped with it to a node) and the
dry start (in the image and on the host) both name the flag an operator meant.
"""

from __future__ import annotations

import argparse
import difflib
import re


def closest_flags(parser: argparse.ArgumentParser, message: str) -> str:
    """``; closest vLLM flag: --x`` for each flag of an "unrecognized arguments" message."""
    unrecognized = re.search(r"unrecognized arguments: (.*)$", message)
    if not unrecognized:
        return ""
    options = [option for action in parser._actions for option in action.option_strings]
    hints = [
        f"{flag} -> {close[0]}"
        for flag in unrecognized[1].split()
        if flag.startswith("-")
        for close in [difflib.get_close_matches(flag.split("=", 1)[0], options, n=1)]
        if close
    ]
    return f"; closest vLLM flag: {', '.join(hints)}" if hints else ""
