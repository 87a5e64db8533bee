# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Preflight joins the two nodes with one collective before any weights load: in local mode the
same code runs both ranks on this host, over loopback with gloo; a link that does not meet
stops preflight with a line naming it."""

from __future__ import annotations

import io
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dspark_launch import launcher
from dspark_launch.errors import LaunchError
from dspark_launch.launcher import Launcher
from dspark_launch.profile import PROFILES_DIR, load_profile
from dspark_launch.runner import Runner
from dspark_launch.site import load_site
from tests.helpers import free_port
from tests.launch.launch_testlib import write_yaml

pytestmark = pytest.mark.multiproc  # two Pythons with torch, as the two ranks


def local_launcher(tmp_path: Path, out: io.StringIO, address: str = "127.0.0.1") -> Launcher:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"  # this Python (with torch), as the site's venv
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    node = {"address": "127.0.0.1", "hf_home": str(tmp_path / "hf"), "state_dir": str(tmp_path)}
    site_file = {
        "profile": "cpu-tiny",
        "mode": "local",
        "venv": str(venv),
        "api_bind": "127.0.0.1",
        "ports": {"api": free_port(), "master": free_port()},
        "head": node,
        "worker": node,
    }
    site = load_site(write_yaml(tmp_path / "site.yaml", site_file))
    site = replace(site, head=replace(site.head, address=address))
    return Launcher(site, load_profile(PROFILES_DIR / "cpu-tiny.yaml"), Runner(out=out))


def test_two_local_ranks_join_over_gloo_and_a_wrong_address_stops_preflight(tmp_path, monkeypatch):
    out = io.StringIO()
    local_launcher(tmp_path / "good", out)._join_nodes({"head": "", "worker": ""})
    said = out.getvalue()
    assert said.count("all_reduce of 64 MiB over gloo") == 2, said
    # Control: a head address no rank can bind or reach (TEST-NET-1) fails within the timeout.
    monkeypatch.setattr(launcher, "LINK_TIMEOUT_S", 5)
    bad = local_launcher(tmp_path / "bad", io.StringIO(), address="192.0.2.1")
    with pytest.raises(LaunchError) as refused:
        bad._join_nodes({"head": "", "worker": ""})
    message = str(refused.value)
    assert message.startswith("the nodes do not join at 192.0.2.1:"), message
    assert "check the link between them" in message and "\n" not in message
    print(message)
