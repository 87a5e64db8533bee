# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Exact unified-diff application on real vLLM sources: what applies, and what is refused."""

import difflib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from installer.unified_diff import PatchError, parse, split_lines
from tests.installer.installer_testlib import (
    EAGLE,
    SPECULATIVE,
    edited_source,
    environment_tree,
    make_diff,
)


@pytest.fixture(scope="module")
def speculative() -> bytes:
    return (environment_tree().root / SPECULATIVE).read_bytes()


@pytest.fixture(scope="module")
def eagle() -> bytes:
    return (environment_tree().root / EAGLE).read_bytes()


def test_applies_a_git_style_diff_exactly(speculative: bytes):
    edited = edited_source(speculative, "x")
    diff = b"diff --git a/x b/x\nindex 1..2 100644\n" + make_diff(SPECULATIVE, speculative, edited)
    patch = parse(diff)
    assert (patch.old_path, patch.new_path) == (SPECULATIVE, SPECULATIVE)
    assert len(patch.hunks) == 2
    assert patch.apply(speculative) == edited


def test_refuses_shifted_context_instead_of_fuzzing(eagle: bytes):
    patch = parse(make_diff(EAGLE, eagle, edited_source(eagle, "x")))
    with pytest.raises(PatchError, match="hunk 1 does not match at line 1"):
        patch.apply(b"# one extra line shifts everything\n" + eagle)


def test_refuses_changed_context(speculative: bytes):
    patch = parse(make_diff(SPECULATIVE, speculative, edited_source(speculative, "x")))
    lines = split_lines(speculative)
    lines[-2] = b"# changed near the tail hunk\n"
    with pytest.raises(PatchError, match="hunk 2 does not match"):
        patch.apply(b"".join(lines))


def test_no_newline_at_end_of_file():
    """As git writes it when neither version ends with a newline."""
    before, after = b"a\nb\nc", b"a\nB\nc\nd"
    diff = (
        b"--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1,3 +1,4 @@\n a\n-b\n-c\n"
        b"\\ No newline at end of file\n+B\n+c\n+d\n\\ No newline at end of file\n"
    )
    assert parse(diff).apply(before) == after


@pytest.mark.parametrize(
    ("diff", "message"),
    [
        (b"", "no '--- a/<file>'"),
        (b"--- a/x\n@@ -1 +1 @@\n", "no '--- a/<file>'"),
        (b"--- a/x\n+++ b/x\n", "no hunks"),
        (b"--- a/x\n+++ b/x\n@@ -1,2 +1,2 @@\n-a\n+b\n", "truncated"),
        (b"--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n--- a/y\n+++ b/y\n", "exactly one file"),
        (b"--- a/x\n+++ b/x\n@@ -1 +1 @@\n?a\n+b\n", "unexpected"),
    ],
)
def test_malformed_diffs_are_refused(diff: bytes, message: str):
    with pytest.raises(PatchError, match=message):
        parse(diff)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_edit_of_a_real_module_round_trips(eagle: bytes, data: st.DataObject):
    """difflib's diff of an arbitrary line edit applies back to exactly the edited bytes."""
    lines = eagle.decode().splitlines(keepends=True)
    for _ in range(data.draw(st.integers(1, 4))):
        index = data.draw(st.integers(0, len(lines)))
        action = data.draw(st.sampled_from(["insert", "delete", "replace"]))
        text = data.draw(st.text(alphabet="abc #()=\t", max_size=12)) + "\n"
        if action == "insert" or not lines or index == len(lines):
            lines.insert(index, text)
        elif action == "delete":
            del lines[index]
        else:
            lines[index] = text
    edited = "".join(lines).encode()
    diff = "".join(
        difflib.unified_diff(eagle.decode().splitlines(keepends=True), lines, "a/x", "b/x", n=3)
    ).encode()
    if edited == eagle:
        return
    assert parse(diff).apply(eagle) == edited
