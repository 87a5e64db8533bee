"""Launcher test fixtures (defined in launch_testlib, registered here)."""

from launch_testlib import cli, fake_cluster  # noqa: F401
