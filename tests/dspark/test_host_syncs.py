# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The host-read recorder on a CPU box: reads of tensors that live on the device on a GPU count,
reads of the runner's host tensors and of what is computed from them only do not."""

import torch

from dspark_fixtures.host_syncs import DeviceReadRecorder, HostSyncRecorder


def recorded(host: list[torch.Tensor], step) -> list[str]:
    syncs = HostSyncRecorder({t.untyped_storage().data_ptr() for t in host})
    with DeviceReadRecorder(syncs.is_host) as reads, syncs:
        step()
    return [read.split(" at ")[0] for read in reads.reads]


def test_every_kind_of_device_read_counts_and_host_reads_do_not(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # no CUDA here
    device = torch.arange(4)
    host = torch.zeros(4, dtype=torch.int64)
    pinned_copy = torch.zeros(4, dtype=torch.int64)

    def step():
        host.tolist()
        (host[1:] - host[:-1]).max().item()  # computed from host tensors only
        pinned_copy.copy_(device, non_blocking=True)
        pinned_copy.tolist()
        device.tolist()
        device.cpu().numpy()  # one transfer
        device[0].item()
        device.to("cpu")
        host.copy_(device)
        bool(device[1])
        torch.cuda.synchronize()

    assert recorded([host, pinned_copy], step) == [
        "tolist",
        "cpu",
        "item",
        "to",
        "copy_",
        "__bool__",
        "synchronize",
    ]


def test_a_device_result_where_host_memory_was_counts():
    """A device result can take memory a host tensor held (on a CPU box the allocator reuses
    it); writing one into a host-derived tensor's storage makes the address deterministic."""
    host = torch.zeros(4)
    device = torch.arange(4.0)

    def step():
        derived = host + 1  # computed from host tensors only: host
        derived.tolist()
        torch.add(device, 1, out=derived)  # now a device result at the same address
        derived.tolist()

    assert recorded([host], step) == ["tolist"]
