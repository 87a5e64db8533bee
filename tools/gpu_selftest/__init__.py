# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""GPU self-test of a DSpark vLLM install: what the CPU test suite cannot prove, in one command,
`python -m tools.gpu_selftest` from the project root (`/opt/dspark` in the images)."""
