# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Count the aten ops that make the host wait for the device on a GPU.

On a CPU run nothing waits, but the same ops still pass through the
dispatcher, so counting them inside a step shows which code would synchronize
once its tensors live on a GPU. Host-side tensors (vLLM's ``*_cpu`` copies)
are counted too: a count is an upper bound on real syncs.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING_OPS = {
    "_local_scalar_dense",  # .item(), bool(tensor), int(tensor)
    "is_nonzero",
    "nonzero",
    "argwhere",
    "masked_select",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "bincount",
    "repeat_interleave",
    "equal",
}


class HostSyncRecorder(TorchDispatchMode):
    """Records the aten ops that make the host wait for device results on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        boolean_index = name.startswith(("index", "_index_put")) and any(
            isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
            for arg in args
            if isinstance(arg, list | tuple)
            for index in arg
        )
        if name in SYNCING_OPS or boolean_index:
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))
