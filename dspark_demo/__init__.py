# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Tiny local models and a demo that runs vLLM with and without DSpark on a CPU."""
