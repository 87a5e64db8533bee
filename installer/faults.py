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


def checkpoint(label: str) -> None:
    global _steps_reached
    _steps_reached += 1
    if os.environ.get(KILL_AT_ENV) == str(_steps_reached):
        sys.stderr.write(f"{KILL_AT_ENV}: killed at step {_steps_reached} ({label})\n")
        sys.stderr.flush()
        os._exit(KILLED_EXIT)
    faults = dict(item.split(":", 1) for item in os.environ.get(FAIL_AT_ENV, "").split(",") if item)
    kind = faults.get(str(_steps_reached))
    if kind == "ENOSPC":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), label)
    if kind == "SIGINT":
        raise KeyboardInterrupt
