# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Launcher test fixtures (defined in launch_testlib, registered here)."""

from tests.launch.launch_testlib import cli, fake_cluster  # noqa: F401
