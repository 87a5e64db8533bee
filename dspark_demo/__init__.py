# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Tiny local models and a demo that runs vLLM with and without DSpark on a CPU.

The demo owns the tiny-engine harness (``engine.py``) that the tests and the benchmarks also
import: the demo is the one user a reader runs first, and it must work from a plain clone
without the test tree, so the harness lives with it rather than under ``tests/``.
"""
