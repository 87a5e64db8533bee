# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Exit codes and the errors that carry them, so every failure maps to one documented code."""

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1
    BAD_TARGET = 2
    REFUSED = 3
    ROLLBACK_FAILED = 4
    NOT_INSTALLED = 5
    PARTIAL = 6
    DRIFTED = 7


class InstallerError(Exception):
    """A user-facing failure: the message names the problem and the fix; no traceback."""

    exit_code = ExitCode.FAILED


class BadTarget(InstallerError):
    """The path or arguments do not designate a usable vLLM tree."""

    exit_code = ExitCode.BAD_TARGET


class Refused(InstallerError):
    """The tree is not one the pins allow touching; nothing was written."""

    exit_code = ExitCode.REFUSED


class RollbackFailed(InstallerError):
    """A rollback could not restore the tree; the journal is kept for manual repair."""

    exit_code = ExitCode.ROLLBACK_FAILED
