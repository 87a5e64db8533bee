# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Keep vLLM's logs off the terminal: everything written to stdout and stderr, by Python, C++
extensions or child processes, goes to a log file while the block runs."""

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def output_to(log: Path) -> Iterator[None]:
    """Point file descriptors 1 and 2 at ``log`` (appended) for the block, then back."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for descriptor in (fd, *saved):
            os.close(descriptor)


def tail(log: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of ``log``."""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
