# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The self-test engines' memory setting, from the free memory vLLM itself measures.

vLLM's worker refuses to start when the free memory it measures at start-up (`MemorySnapshot`:
on an integrated GPU such as GB10, the host's available memory) is below
`gpu_memory_utilization` x the device's total (`request_memory`), whatever
`kv_cache_memory_bytes` says. vLLM's default utilization (0.92 of 121.69 GiB) is above the
~101-102 GiB a GB10 has free at boot, so the engines ask for a share of what vLLM measures free
instead.
"""

from __future__ import annotations

import math

# Of the free memory vLLM measures, what an engine may ask for: the rest stays for the other
# processes on the device (on unified memory, the host's).
FREE_SHARE = 0.9


def utilization_for(free_memory: int, total_memory: int) -> float:
    """A `gpu_memory_utilization` that `request_memory` accepts with `free_memory` free: at
    most FREE_SHARE of it, in hundredths, never above vLLM's default."""
    from vllm.config import CacheConfig

    default = CacheConfig().gpu_memory_utilization
    share = math.floor(100 * FREE_SHARE * free_memory / total_memory) / 100
    return min(default, share)


def measured_utilization() -> float:
    """`utilization_for` this device's free memory, as vLLM's worker measures it."""
    import torch

    from vllm.utils.mem_utils import MemorySnapshot

    snapshot = MemorySnapshot(device=torch.device("cuda", 0))
    return utilization_for(snapshot.free_memory, snapshot.total_memory)
