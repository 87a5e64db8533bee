# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Errors that end a launcher command, each with the exit code the command returns."""

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILURE = 1
    BAD_CONFIG = 2
    ALREADY_RUNNING = 3


class LaunchError(Exception):
    """A runtime failure: a check failed, a rank exited, a node is unreachable."""

    exit_code = ExitCode.FAILURE


class ConfigError(LaunchError):
    """The site file or profile is invalid; raised before any side effect."""

    exit_code = ExitCode.BAD_CONFIG


class AlreadyRunning(LaunchError):
    """Both ranks are already up: `start` has nothing to do (systemd treats 3 as success)."""

    exit_code = ExitCode.ALREADY_RUNNING
