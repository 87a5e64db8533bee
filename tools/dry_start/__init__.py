# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Dry start: vLLM's own start-up of a serving profile without the GPU or the weights
(docs/dry-start.md)."""
