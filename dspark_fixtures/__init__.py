# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""What the tests, the benchmarks, the demo and the GPU self-test build on: tiny local checkpoints
(``checkpoints``), the in-process engine harness (``engine``), the host-sync recorder
(``host_syncs``), and CPU stand-ins for what this host lacks (Triton kernels, DeepSeek-V4's C++
ops and quantised kernels, CUDA graphs). Outside ``tests/``, so that the demo and the images work
without the test tree."""
