# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Hostile and broken input: state files that point outside the tree, undecodable dist-info and
state files, a missing RECORD, a full disk, Ctrl-C at every step, symlinked targets and
over-long paths. Each gives one clear line, its documented exit code, and no write outside."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from installer.errors import ExitCode
from installer.faults import FAIL_AT_ENV, KILL_AT_ENV, KILLED_EXIT
from installer.hashing import sha256_hex
from installer.state import JOURNAL, RECORD
from tests.helpers import replace_file
from tests.installer.installer_testlib import TOUCHED, GeneratedProject, snapshot, sources

pytestmark = pytest.mark.parametrize("version", ["0.32.0"])
VICTIM = b"not vLLM's\n"


def one_line_error(result, code: ExitCode, *phrases: str) -> None:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if not line.startswith("note: ")]
    assert len(lines) == 1 and lines[0].startswith("install.py: "), result.stderr
    for phrase in phrases:
        assert phrase in result.stderr, (phrase, result.stderr)


def edit_json(path: Path, edit) -> None:
    document = json.loads(path.read_text())
    edit(document)
    replace_file(path, json.dumps(document).encode())


def hostile_paths(tree: Path) -> dict[str, Path]:
    """Spellings of a path out of the tree, and the victim file each one names."""
    outside = tree.parent / "outside"
    outside.mkdir(exist_ok=True)
    (tree / "vllm" / "escape").symlink_to(outside, target_is_directory=True)
    return {
        "../victim.txt": tree.parent / "victim.txt",
        "vllm/../../victim.txt": tree.parent / "victim.txt",
        str(outside / "victim.txt"): outside / "victim.txt",
        "vllm/escape/victim.txt": outside / "victim.txt",
    }


def test_record_entry_outside_the_tree_is_refused(project: GeneratedProject, tree: Path):
    assert project.install(tree).returncode == ExitCode.OK
    for hostile, victim in hostile_paths(tree).items():
        victim.write_bytes(VICTIM)
        entry = {
            "path": hostile,
            "kind": "overlay",
            "pre_sha256": None,
            "post_sha256": sha256_hex(VICTIM),
        }
        edit_json(tree / RECORD, lambda record, entry=entry: record["files"].append(entry))
        before = snapshot(tree)
        for args in (("--uninstall", "--force"), ("--uninstall",), (), ("--status",)):
            result = project.install(tree, *args)
            one_line_error(result, ExitCode.REFUSED, repr(hostile), "nothing was changed")
            assert victim.read_bytes() == VICTIM, (hostile, args)
            assert snapshot(tree) == before
        edit_json(tree / RECORD, lambda record: record["files"].pop())
    edit_json(tree / RECORD, lambda record: record["created_dirs"].append("vllm/../../made"))
    one_line_error(project.install(tree, "--uninstall"), ExitCode.REFUSED, "vllm/../../made")


def test_journal_entry_outside_the_tree_is_refused(project: GeneratedProject, tree: Path):
    """A journal entry whose file "did not exist before" is deleted by the repair: unless it
    lies outside the tree. A new_dirs entry outside is never created or removed either."""
    for hostile, victim in hostile_paths(tree).items():
        victim.write_bytes(VICTIM)
        journal = {
            "schema": 1,
            "operation": "install",
            "entries": [{"path": hostile, "before_sha256": None, "after_sha256": None}],
            "new_dirs": [],
        }
        (tree / JOURNAL).parent.mkdir(parents=True, exist_ok=True)
        replace_file(tree / JOURNAL, json.dumps(journal).encode())
        for args in ((), ("--status",), ("--uninstall",)):
            one_line_error(project.install(tree, *args), ExitCode.REFUSED, repr(hostile))
            assert victim.read_bytes() == VICTIM, (hostile, args)


@pytest.mark.parametrize(
    "content",
    [b"\xff\xfe{}", b"[]", b'"record"', b"{", b'{"schema": 1, "files": "x"}'],
    ids=["not-utf8", "list", "string", "truncated", "wrong-types"],
)
def test_malformed_state_files_give_one_line(project: GeneratedProject, tree: Path, content: bytes):
    assert project.install(tree).returncode == ExitCode.OK
    record = (tree / RECORD).read_bytes()
    for path in (RECORD, JOURNAL):
        replace_file(tree / path, content)
        for args in ((), ("--status",)):
            result = project.install(tree, *args)
            one_line_error(result, ExitCode.ROLLBACK_FAILED, f"{path} is corrupt")
        (tree / path).unlink()
    replace_file(tree / RECORD, record)
    assert project.install(tree, "--uninstall").returncode == ExitCode.OK


@pytest.mark.parametrize("name", ["RECORD", "METADATA"])
def test_undecodable_dist_info_gives_one_line(project: GeneratedProject, tree: Path, name: str):
    (dist_file,) = tree.glob(f"vllm*.dist-info/{name}")
    replace_file(dist_file, dist_file.read_bytes() + b"\n\xff\xfe broken\n")
    before = snapshot(tree)
    for args in ((), ("--status",), ("--uninstall",), ("--dry-run",)):
        result = project.install(tree, *args)
        one_line_error(result, ExitCode.BAD_TARGET, f"{name} is unreadable", "Reinstall")
    assert snapshot(tree) == before


def test_missing_record_is_reported(project: GeneratedProject, tree: Path):
    for dist_info in tree.glob("vllm*.dist-info"):
        shutil.rmtree(dist_info)
    result = project.install(tree)
    assert result.returncode == ExitCode.OK, result.stderr
    assert "note: no vLLM dist-info" in result.stderr
    assert "the RECORD check was skipped" in result.stderr
    status = json.loads(project.install(tree, "--status", "--json").stdout)
    assert any("the RECORD check was skipped" in note for note in status["notes"])


def step_label(project: GeneratedProject, tree: Path, step: int) -> str | None:
    """What the installer does at `step` (killed there); None when it finishes earlier."""
    result = project.install(tree, env={KILL_AT_ENV: str(step)})
    if result.returncode != KILLED_EXIT:
        assert project.install(tree, "--uninstall").returncode == ExitCode.OK
        return None
    assert project.install(tree, "--status").returncode == ExitCode.NOT_INSTALLED
    return re.search(r"killed at step \d+ \((.*)\)", result.stderr).group(1)


def test_full_disk_is_reported_and_kept_when_rollback_fails(project: GeneratedProject, tree: Path):
    before = sources(tree)
    first_replaced = next(
        step for step in range(1, 40) if step_label(project, tree, step).endswith(" replaced")
    )
    # The second file's temp file hits a full disk; the rollback's first write hits it again.
    assert step_label(project, tree, first_replaced + 1).startswith("temp file of")
    result = project.install(tree, env={FAIL_AT_ENV: f"{first_replaced + 1}:ENOSPC"})
    one_line_error(result, ExitCode.FAILED, "install failed while writing", "the disk is full")
    assert "Every change was rolled back" in result.stderr
    assert sources(tree) == before

    faults = f"{first_replaced + 1}:ENOSPC,{first_replaced + 2}:ENOSPC"
    result = project.install(tree, env={FAIL_AT_ENV: faults})
    one_line_error(result, ExitCode.ROLLBACK_FAILED, "rolling back the install failed")
    first, _, second = result.stderr.partition("rolling back")
    assert "install failed while writing" in first and "the disk is full" in first
    assert "the disk is full" in second and "is kept" in second
    assert project.install(tree, "--status").returncode == ExitCode.NOT_INSTALLED, "repaired"
    assert sources(tree) == before


def test_full_disk_while_saving_originals(project: GeneratedProject, tree: Path):
    before = sources(tree)
    result = project.install(tree, env={FAIL_AT_ENV: "1:ENOSPC"})
    one_line_error(result, ExitCode.FAILED, "the disk is full", "Free space on the file system")
    assert sources(tree) == before


@pytest.mark.multiproc  # the installer interrupted in a subprocess at each step
def test_ctrl_c_at_every_step(project: GeneratedProject, tree: Path):
    before = sources(tree, TOUCHED)
    step = 1
    while (result := project.install(tree, env={FAIL_AT_ENV: f"{step}:SIGINT"})).returncode:
        assert result.returncode in (ExitCode.FAILED, ExitCode.ROLLBACK_FAILED), step
        one_line_error(result, result.returncode, "interrupted")
        repair = project.install(tree, "--uninstall")
        assert repair.returncode == ExitCode.OK and "Traceback" not in repair.stderr, step
        assert sources(tree, TOUCHED) == before, step
        step += 1
    assert step > 20, f"only {step} steps: the test no longer reaches the commit"


def test_ctrl_c_during_start_up(project: GeneratedProject, tree: Path, tmp_path: Path):
    (tmp_path / "yaml.py").write_text("raise KeyboardInterrupt\n")  # Ctrl-C while importing
    env = {"PYTHONPATH": str(tmp_path)}
    one_line_error(project.install(tree, env=env), ExitCode.FAILED, "interrupted before it started")


@pytest.mark.parametrize("inside", [True, False], ids=["link-inside", "link-outside"])
def test_symlinked_patch_target_comes_back_as_the_same_symlink(
    project: GeneratedProject, tree: Path, inside: bool
):
    """Install replaces the link with the patched file (never writing through it); a rollback
    and an uninstall make it the same link again, and the file it points to is never touched."""
    target = tree / "vllm/config/speculative.py"
    real = (tree / "vllm/config" if inside else tree.parent) / "speculative_real.py"
    real.write_bytes(target.read_bytes())
    original = real.read_bytes()
    link = os.path.relpath(real, target.parent) if inside else str(real)
    target.unlink()
    target.symlink_to(link)

    replaced = next(
        step
        for step in range(1, 40)
        if step_label(project, tree, step) == "vllm/config/speculative.py replaced"
    )
    failed = project.install(tree, env={FAIL_AT_ENV: f"{replaced + 1}:ENOSPC"})
    assert failed.returncode == ExitCode.FAILED, failed.stderr
    assert target.is_symlink() and os.readlink(target) == link, "rolled back to the link"

    assert project.install(tree).returncode == ExitCode.OK
    assert not target.is_symlink() and target.read_bytes() != original
    assert real.read_bytes() == original
    result = project.install(tree, "--uninstall")
    assert result.returncode == ExitCode.OK, result.stderr
    assert target.is_symlink() and os.readlink(target) == link
    assert real.read_bytes() == original


def test_over_long_path_is_a_bad_argument(project: GeneratedProject, tmp_path: Path):
    path = tmp_path / ("x" * 300) / "vllm"
    one_line_error(project.install(path), ExitCode.BAD_TARGET, "File name too long")
