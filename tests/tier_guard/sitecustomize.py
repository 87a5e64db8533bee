# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Python runs this at start-up in a child of a unit-tier test (engine_guard.py says why)."""

import os

if os.environ.get("DSPARK_UNIT_TIER_RECORD"):
    import engine_guard

    engine_guard.install(child=True)
