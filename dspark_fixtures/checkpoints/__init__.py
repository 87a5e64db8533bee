# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Tiny local checkpoints, one module per family, built on disk from scratch (no hub access):
``qwen3`` (targets, DSpark and DFlash drafts), ``gemma4`` (target and DSpark drafts),
``deepseek_v4`` (a target carrying its ``mtp.*`` draft) and ``deepseek_v4_quantised`` (that
checkpoint quantised as DeepSeek-V4-Flash ships). The tests, the demo, the benchmarks and the
GPU self-test (inside the images) build from here; ``common`` holds what the families share."""
