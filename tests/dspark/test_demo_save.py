# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""`python -m dspark_demo --save DIR` leaves a complete pair in DIR or nothing at all: Ctrl-C and
a full disk while the pair is written, and paths that cannot hold it (a file, a folder under a
file, a read-only filesystem), end with one line and leave nothing behind; a folder left by an
interrupted run is named. The pair's writing is a stand-in that fails where the test says (its
real writing is the end-to-end test in test_demo.py); the rest is the demo's own `main`."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

import dspark_demo.__main__ as demo
from dspark_demo.saved_pair import PARTIAL, save_pair


def stand_in(fault: BaseException | None):
    """A pair writer that writes the target's 0-byte config.json, then fails with `fault`, or
    writes the rest."""

    def build_pair(pair: str, root: Path, chat_template: bool = False) -> tuple[Path, Path]:
        (root / "target").mkdir()
        (root / "target" / "config.json").write_bytes(b"")
        if fault is not None:
            raise fault
        (root / "draft").mkdir()
        (root / "draft" / "config.json").write_text("{}")
        return root / "target", root / "draft"

    return build_pair


@pytest.fixture
def run_demo(monkeypatch, capfd):
    """`main(--save DIR ...)` with the pair writer failing as asked: (status, stderr lines)."""
    monkeypatch.setattr(demo, "dspark_missing", lambda: None)

    def run(save: Path, fault: BaseException | None = None) -> tuple[int, list[str]]:
        monkeypatch.setattr(demo, "build_pair", stand_in(fault))
        try:
            status = demo.main(["--save", str(save), "--repeats", "1"])
        except SystemExit as error:  # argparse's refusal
            status = int(error.code or 0)
        return status, capfd.readouterr().err.strip().splitlines()

    return run


def left_behind(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


@pytest.mark.parametrize(
    ("fault", "status", "said"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), 1, "No space left on device"),
        (KeyboardInterrupt(), 130, None),
    ],
    ids=["full disk", "ctrl-c"],
)
def test_a_failed_save_leaves_nothing(tmp_path, run_demo, fault, status, said):
    save = tmp_path / "pair"
    code, lines = run_demo(save, fault)
    assert code == status
    expected = (
        f"dspark_demo: --save {save}: {said}; nothing was saved"
        if said
        else "dspark_demo: interrupted; nothing was saved"
    )
    assert lines[-1] == expected
    assert left_behind(tmp_path) == []


def test_a_read_only_filesystem_leaves_nothing(tmp_path, run_demo, monkeypatch):
    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert run_demo(tmp_path / "pair") == (
        1,
        [f"dspark_demo: --save {tmp_path / 'pair'}: Read-only file system; nothing was saved"],
    )
    assert left_behind(tmp_path) == []


def test_paths_that_cannot_hold_the_pair_are_refused_first(tmp_path, run_demo):
    file = tmp_path / "file"
    file.write_text("x")
    code, lines = run_demo(file)
    assert (code, lines[-1]) == (
        2,
        f"python -m dspark_demo: error: --save {file} is a regular file; name a new folder",
    )
    code, lines = run_demo(file / "pair")
    assert (code, lines[-1]) == (
        2,
        f"python -m dspark_demo: error: --save {file / 'pair'}: its folder {file} is a regular "
        "file; name a folder inside one",
    )
    assert left_behind(tmp_path) == ["file"]


def test_a_folder_left_by_an_interrupted_run_is_named(tmp_path, run_demo):
    left = tmp_path / f".pair{PARTIAL}4242"
    left.mkdir()
    code, lines = run_demo(tmp_path / "pair")
    assert code == 2
    assert lines[-1] == (
        f"python -m dspark_demo: error: --save {left} is a folder left by an interrupted --save; "
        f"delete it (rm -r {left})"
    )


def test_a_complete_pair_takes_the_name_only_when_written(tmp_path, run_demo, monkeypatch):
    """The pair is renamed into place whole, also over an empty folder the operator made."""
    save = tmp_path / "pair"
    save.mkdir()
    seen = []

    def build(root: Path) -> tuple[Path, Path]:
        seen.append(left_behind(tmp_path))
        return stand_in(None)("oracle", root)

    target, draft = save_pair(save, build)
    assert seen == [[f".pair{PARTIAL}{os.getpid()}", "pair"]]
    assert (target, draft) == (save / "target", save / "draft")
    assert left_behind(save) == ["draft", "target"] and left_behind(tmp_path) == ["pair"]
    (save / "notes.txt").write_text("mine")
    code, lines = run_demo(save)
    assert (code, lines[-1]) == (
        2,
        f"python -m dspark_demo: error: --save {save}: the directory is not empty; name a new one",
    )


def test_a_pair_left_incomplete_in_place_is_named(tmp_path, run_demo):
    """What an interrupted save of an earlier version (which wrote in place) left: a 0-byte
    config.json and no draft."""
    save = tmp_path / "pair"
    (save / "target").mkdir(parents=True)
    (save / "target" / "config.json").write_bytes(b"")
    code, lines = run_demo(save)
    assert (code, lines[-1]) == (
        2,
        f"python -m dspark_demo: error: --save {save} holds an incomplete pair, left by an "
        f"interrupted --save; delete it (rm -r {save}) or name a new folder",
    )


def test_a_path_is_quoted_on_one_line(tmp_path, run_demo):
    evil = tmp_path / "x\n\x1b[2Kok: saved"
    code, lines = run_demo(evil / "pair")
    assert code == 2 and lines[-1].isprintable()
    assert lines[-1].endswith("x\\n\\x1b[2Kok: saved does not exist; name a folder inside one")
