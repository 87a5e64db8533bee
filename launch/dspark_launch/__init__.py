# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Two-node launcher for vLLM with DSpark: profiles, site files, preflight, start, stop."""
