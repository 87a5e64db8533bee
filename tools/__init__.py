# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Command-line tools of this checkout: `python -m tools.gpu_selftest`, `tools/refresh_pins.py`."""
