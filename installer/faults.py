# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Test hooks that break the installer at its N-th durable step, to prove crash recovery.

- DSPARK_INSTALL_KILL_AT=N: the process exits abruptly (os._exit, like SIGKILL: no cleanup, no
  rollback) when it reaches step N.
- DSPARK_INSTALL_FAIL_AT=N:KIND[,N:KIND...]: at step N raise what KIND names: `ENOSPC` an
  OSError as from a full disk, `SIGINT` a KeyboardInterrupt as from Ctrl-C.

Steps are counted across the whole run, repair included.
"""

import errno
import os
import sys

KILL_AT_ENV = "DSPARK_INSTALL_KILL_AT"
FAIL_AT_ENV = "DSPARK_INSTALL_FAIL_AT"
KILLED_EXIT = 137  # what a shell reports for SIGKILL

_steps_reached = 0


class FaultSpecError(ValueError):
    """DSPARK_INSTALL_FAIL_AT is malformed."""


def _faults() -> dict[str, str]:
    text = os.environ.get(FAIL_AT_ENV, "")
    faults = {}
    for item in filter(None, text.split(",")):
        step, _, kind = item.partition(":")
        if not step.isdigit() or kind not in ("ENOSPC", "SIGINT"):
            raise FaultSpecError(
                f"{FAIL_AT_ENV}={text[:80]!r}: expected N:KIND[,N:KIND...] with KIND ENOSPC "
                f"or SIGINT; unset it (it is a test hook)"
            )
        faults[step] = kind
    return faults


def check_env() -> None:
    """Refuse a malformed fault spec before anything is written."""
    _faults()


def checkpoint(label: str) -> None:
    global _steps_reached
    _steps_reached += 1
    if os.environ.get(KILL_AT_ENV) == str(_steps_reached):
        sys.stderr.write(f"{KILL_AT_ENV}: killed at step {_steps_reached} ({label})\n")
        sys.stderr.flush()
        os._exit(KILLED_EXIT)
    kind = _faults().get(str(_steps_reached))
    if kind == "ENOSPC":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), label)
    if kind == "SIGINT":
        raise KeyboardInterrupt
