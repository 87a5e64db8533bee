# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The DGX Spark owner's path around the server: image-ID pins, config readers that neither hang
nor crash, one line-break rule for env values, and local-mode state the launcher can trust."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dspark_launch.render import NodePlan, parse_env_file
from tests.launch.launch_testlib import REPO, write_yaml

LAUNCHER = REPO / "launch" / "dspark-launch"
IMAGE_ID = "sha256:" + "c" * 64


# item 2: an image pin that works with `docker load` ------------------------------------------


def _pin_image_id(cluster, image: str = IMAGE_ID) -> None:
    site = yaml.safe_load(cluster.site.read_text())
    site["image"] = image
    write_yaml(cluster.site, site)


def test_an_image_id_pin_passes_preflight_when_both_nodes_hold_it(fake_cluster, cli):
    _pin_image_id(fake_cluster)
    fake_cluster.scenario(head={"image_id": IMAGE_ID}, worker={"image_id": IMAGE_ID})
    result = cli("--site", fake_cluster.site, "preflight")
    assert result.rc == 0, result.err
    inspected = [e["argv"] for e in fake_cluster.commands() if e["argv"][:2] == ["docker", "image"]]
    assert len(inspected) == 2 and all(argv[-1] == IMAGE_ID for argv in inspected)


def test_an_image_id_pin_fails_preflight_on_another_image(fake_cluster, cli):
    _pin_image_id(fake_cluster)
    fake_cluster.scenario(head={"image_id": "sha256:img1"}, worker={"image_id": "sha256:img1"})
    result = cli("--site", fake_cluster.site, "preflight")
    assert result.rc == 1
    assert f"head: {IMAGE_ID} resolves to image sha256:img1" in result.err


def test_a_missing_image_id_says_to_load_it(fake_cluster, cli):
    _pin_image_id(fake_cluster)
    fake_cluster.scenario(head={"image_id": IMAGE_ID}, worker={"image_id": None})
    result = cli("--site", fake_cluster.site, "preflight")
    assert result.rc == 1 and "docker load" in result.err and "docker pull" not in result.err


@pytest.mark.parametrize("image", ["sha256:" + "c" * 63, "sha256:" + "C" * 64, "c" * 64])
def test_malformed_image_ids_are_refused(fake_cluster, cli, image):
    _pin_image_id(fake_cluster, image)
    result = cli("--site", fake_cluster.site, "preflight")
    assert result.rc == 2 and "image ID (sha256:...)" in result.err


def test_containers_share_the_documented_jit_cache_volume(fake_cluster, cli):
    docs = (REPO / "docs" / "docker.md").read_text() + (REPO / "README.md").read_text()
    fake_cluster.scenario()
    result = cli("--site", fake_cluster.site, "--dry-run", "start")
    assert "--volume dspark-jit-cache:/var/cache/dspark" in result.out
    assert "dspark-jit-cache:/var/cache/dspark" in docs and "dspark-cache:" not in docs


# item 5: config readers and CLIs that cannot hang or crash -----------------------------------


def _cli_site(cluster, text: str) -> Path:
    cluster.site.write_text(text)
    return cluster.site


def test_an_alias_bomb_in_the_site_file_is_refused_at_once(fake_cluster, cli):
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n"
        for a, b in zip("abcdefgh", "bcdefghi", strict=True)
    )
    started = time.monotonic()
    result = cli("--site", _cli_site(fake_cluster, bomb), "preflight")
    assert result.rc == 2 and "once its aliases are expanded" in result.err
    assert len(result.err) < 400 and time.monotonic() - started < 10


def test_deep_nesting_is_refused_in_one_line(fake_cluster, cli):
    result = cli("--site", _cli_site(fake_cluster, "a: " + "[" * 3000 + "]" * 3000), "preflight")
    assert result.rc == 2 and "nested deeper than 32 levels" in result.err


def test_an_over_long_profile_name_is_bad_configuration(fake_cluster, cli):
    site = yaml.safe_load(fake_cluster.site.read_text())
    site["profile"] = "p" * 5000
    write_yaml(fake_cluster.site, site)
    result = cli("--site", fake_cluster.site, "preflight")
    assert result.rc == 2 and "File name too long" in result.err and len(result.err) < 600


def test_an_unbounded_value_is_cut_in_the_message(fake_cluster, cli):
    site = yaml.safe_load(fake_cluster.site.read_text())
    site["api_bind"] = "x" * 100_000
    write_yaml(fake_cluster.site, site)
    result = cli("--site", fake_cluster.site, "preflight")
    assert result.rc == 2 and "api_bind" in result.err and len(result.err) < 400


def _launcher(*args: str, python_prefix: str = "", pipe: str = "") -> subprocess.CompletedProcess:
    """Run the launcher script for real; `python_prefix` runs first in its interpreter."""
    code = f"{python_prefix}import runpy, sys; sys.argv = ['dspark-launch', *sys.argv[1:]]; "
    code += f"runpy.run_path({str(LAUNCHER)!r}, run_name='__main__')"
    command = [sys.executable, "-c", code, *args]
    if pipe:
        return subprocess.run(
            " ".join(map(_quote, command)) + pipe,
            shell=True,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def test_without_pyyaml_help_works_and_commands_name_the_fix(fake_cluster):
    hide = "import sys; sys.modules['yaml'] = None; "
    assert _launcher("--help", python_prefix=hide).returncode == 0
    result = _launcher("--site", str(fake_cluster.site), "preflight", python_prefix=hide)
    assert result.returncode == 2
    assert "'yaml' (PyYAML) is missing" in result.stderr and "pip install pyyaml" in result.stderr
    assert "Traceback" not in result.stderr


def test_output_into_a_closed_pipe_is_quiet(tmp_path):
    site, run = _local(tmp_path)
    run.mkdir(mode=0o700)
    (run / "head.log").write_text("".join(f"log line {n}\n" for n in range(200_000)))
    result = _launcher(
        "--site", str(site), "logs", "--node", "head", "-n", "200000", pipe=" | head -n 1"
    )
    assert result.stdout == "---- head ----\n"
    assert "Traceback" not in result.stderr and "Broken pipe" not in result.stderr, result.stderr


# item 6: one rule for env values -------------------------------------------------------------


def test_the_line_break_rule_is_every_character_splitlines_splits_on():
    from dspark_launch.schema import LINE_BREAKS

    splitting = {chr(c) for c in range(0x110000) if len(f"a{chr(c)}b".splitlines()) > 1}
    assert set(LINE_BREAKS) == splitting


SPLITTING = sorted({chr(c) for c in range(0x3000) if len(f"a{chr(c)}b".splitlines()) > 1})


@pytest.mark.parametrize("char", [*SPLITTING, "\0"])
def test_env_values_and_secrets_with_any_line_break_are_refused(fake_cluster, cli, char):
    site = yaml.safe_load(fake_cluster.site.read_text())
    site["secrets"]["api_key"] = f"abc{char}VLLM_LOGGING_LEVEL=DEBUG"
    write_yaml(fake_cluster.site, site)
    result = cli("--site", fake_cluster.site, "preflight")
    assert result.rc == 2 and "secrets.api_key: must be a single line" in result.err
    assert "VLLM_LOGGING_LEVEL" not in result.err


def test_the_env_file_reads_back_what_docker_reads(tmp_path):
    env = {"A": "tab\there", "B": "non\u00a0breaking = # not a comment", "C": "  spaced  "}
    plan = NodePlan(node=None, serve_args=(), env=env, secret_keys=frozenset())  # type: ignore[arg-type]
    assert parse_env_file(plan.env_file_text()) == env
    with pytest.raises(ValueError, match="line break"):
        NodePlan(None, (), {"A": "abc\u2028B=1"}, frozenset()).env_file_text()  # type: ignore[arg-type]
    assert parse_env_file("A=abc\u2028B=1\n") == {"A": "abc\u2028B=1"}


# item 7: local-mode state the launcher can trust ---------------------------------------------


def _local(tmp_path: Path) -> tuple[Path, Path]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "bin" / "vllm").write_text("#!/bin/sh\nsleep 300\n")
    (venv / "bin" / "vllm").chmod(0o755)
    node = {
        "address": "127.0.0.1",
        "hf_home": str(tmp_path / "hf"),
        "state_dir": str(tmp_path / "run"),
    }
    site = {
        "profile": "cpu-tiny",
        "mode": "local",
        "venv": str(venv),
        "api_bind": "127.0.0.1",
        "ports": {"api": 18881, "master": 18882},
        "head": node,
        "worker": node,
    }
    return write_yaml(tmp_path / "site.yaml", site), tmp_path / "run"


def test_a_state_dir_that_is_a_file_is_one_line(tmp_path, cli):
    site, run = _local(tmp_path)
    run.write_text("")
    result = cli("--site", site, "status")
    assert result.rc == 2 and "exists and is not a directory" in result.err


def test_a_state_dir_others_can_write_is_refused(tmp_path, cli):
    site, run = _local(tmp_path)
    run.mkdir()
    run.chmod(0o777)
    result = cli("--site", site, "status")
    assert result.rc == 2 and f"chmod 700 {run}" in result.err


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_a_state_dir_of_another_user_is_refused(tmp_path, cli):
    site, run = _local(tmp_path)
    run.mkdir(mode=0o700)
    os.chown(run, 4242, -1)
    result = cli("--site", site, "status")
    assert result.rc == 2 and "owned by uid 4242" in result.err


def test_a_planted_pid_file_never_makes_stop_signal_another_group(tmp_path, cli):
    site, run = _local(tmp_path)
    run.mkdir(mode=0o700)
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        start_time = Path(f"/proc/{other.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        (run / "head.pid").write_text(f"{other.pid} {start_time}\n")
        status = cli("--site", site, "status")
        assert status.rc == 1 and f"head: exited (pid {other.pid})" in status.out
        assert cli("--site", site, "stop").rc == 0
        assert other.poll() is None  # still running: never signalled
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()


def test_the_log_is_never_opened_through_a_symlink(tmp_path, cli):
    site, run = _local(tmp_path)
    run.mkdir(mode=0o700)
    target = tmp_path / "precious"
    target.write_text("keep\n")
    (run / "head.log").symlink_to(target)
    result = cli("--site", site, "logs", "--node", "head")
    assert result.rc == 1 and "is a symbolic link" in result.err
    assert target.read_text() == "keep\n"


def test_logs_lines_and_exit_codes(tmp_path, cli, capsys):
    site, run = _local(tmp_path)
    for bad in ("0", "-3", "x"):
        with pytest.raises(SystemExit) as caught:
            cli("--site", site, "logs", "-n", bad)
        assert caught.value.code == 2
    capsys.readouterr()
    missing = cli("--site", site, "logs")
    assert missing.rc == 1 and "no log at" in missing.err
    run.mkdir(mode=0o700, exist_ok=True)
    (run / "head.log").write_text("one\ntwo\nthree\n")
    (run / "worker.log").write_text("")
    result = cli("--site", site, "logs", "--node", "head", "-n", "2")
    assert result.rc == 0 and result.out.endswith("two\nthree\n") and "one" not in result.out


def test_dry_run_status_says_it_probed_nothing(tmp_path, cli):
    site, _ = _local(tmp_path)
    result = cli("--site", site, "--dry-run", "status")
    assert result.rc == 0 and "not probed" in result.out and "healthy" not in result.out
