# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DSpark speculative decoding: draft state kept per request, not per batch row."""

__version__ = "0.1.0"
"""dspark-vllm's release (CHANGELOG.md); install.py records it and ``--status`` prints it."""
