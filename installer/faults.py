"""Test hook that kills the installer at its N-th durable step, to prove crash recovery.

Set DSPARK_INSTALL_KILL_AT=N: the process exits abruptly (os._exit, like SIGKILL: no cleanup,
no rollback) when it reaches step N. Steps are counted across the whole run, repair included.
"""

import os
import sys

KILL_AT_ENV = "DSPARK_INSTALL_KILL_AT"
KILLED_EXIT = 137  # what a shell reports for SIGKILL

_steps_reached = 0


def checkpoint(label: str) -> None:
    global _steps_reached
    _steps_reached += 1
    if os.environ.get(KILL_AT_ENV) == str(_steps_reached):
        sys.stderr.write(f"{KILL_AT_ENV}: killed at step {_steps_reached} ({label})\n")
        sys.stderr.flush()
        os._exit(KILLED_EXIT)
