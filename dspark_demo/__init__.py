# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""A demo that runs vLLM with and without DSpark on tiny local models on a CPU
(``python -m dspark_demo``), built on the fixtures package ``dspark_fixtures``."""
