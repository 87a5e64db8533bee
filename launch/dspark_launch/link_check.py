# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The two nodes joined by one collective before any weights load.

Runs in each rank's runtime, with the environment, network and devices the serving rank gets
(the launcher pipes this file to `python3 - --join ADDRESS:PORT --node-rank N --timeout-s S` on
both nodes at once): torch.distributed meets at the serving ranks' master address and port, with
the backend vLLM's ranks use (NCCL on a CUDA device, over RoCE where the profile asks; gloo on a
CPU), and all-reduces a buffer a few times. A link that does not meet, or does not finish within
the timeout, stops preflight in seconds instead of after minutes of loading weights.
Prints one JSON object: {"ok": bool, "detail": str}; exit status 0 when the ranks joined.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import threading
import time

MIB = 1 << 20
ROUNDS = 5
# The link's variables, named in a failure so the reader knows which link was tried.
LINK_ENV = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "GLOO_SOCKET_IFNAME")


def link(address: str, rank: int) -> str:
    named = ", ".join(f"{name}={os.environ[name]}" for name in LINK_ENV if os.environ.get(name))
    return f"rank {rank} to {address}" + (f" ({named})" if named else "")


def answer(ok: bool, detail: str) -> None:
    print(json.dumps({"ok": ok, "detail": detail}), flush=True)


def join(address: str, port: int, rank: int, timeout_s: float, mib: int) -> str:
    """All-reduce `mib` MiB between the two ranks; returns what was measured."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"  # what vLLM's ranks use on this device
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        buffer = torch.full((mib * MIB // 4,), float(rank + 1), device=device)
        dist.all_reduce(buffer)  # the first one sets up the link
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(ROUNDS):
            buffer.fill_(float(rank + 1))
            dist.all_reduce(buffer)
        if cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - started) / ROUNDS
        if buffer[0].item() != 3.0:
            raise RuntimeError(f"all_reduce summed 1 + 2 to {buffer[0].item()}")
    finally:
        dist.destroy_process_group()
    return f"all_reduce of {mib} MiB over {backend} in {seconds * 1e3:.1f} ms"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--join", required=True, metavar="ADDRESS:PORT")
    parser.add_argument("--node-rank", type=int, required=True, choices=(0, 1))
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--mib", type=int, default=64, help="the buffer to all-reduce")
    options = parser.parse_args(argv)
    address, _, port = options.join.rpartition(":")
    where = link(options.join, options.node_rank)

    def too_slow() -> None:
        answer(False, f"{where}: no collective within {options.timeout_s:.0f} s")
        os._exit(1)

    watchdog = threading.Timer(options.timeout_s, too_slow)
    watchdog.daemon = True
    watchdog.start()
    try:
        measured = join(address, int(port), options.node_rank, options.timeout_s, options.mib)
    except Exception as error:  # the backend's own reason: refused, timed out, no device
        reason = " ".join(str(error).split()) or type(error).__name__
        answer(False, f"{where}: {reason[:400]}")
        return 1
    watchdog.cancel()
    answer(True, f"{where}: {measured}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
