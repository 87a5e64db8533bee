# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The refusal note a worker leaves for the frontend (pure: files only; the engine tests in
tests/engine/test_refusal_last_line.py show it reaching the last line)."""

import os
import stat

import pytest

from vllm.v1.spec_decode.dspark import refusal


@pytest.fixture
def notes(tmp_path, monkeypatch):
    monkeypatch.setattr(refusal.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    return tmp_path


def test_a_recorded_refusal_is_raised_once_and_removed(notes):
    refusal.record_refusal("123", "k=9 exceeds 7. Use k <= 7.")
    refusal.record_refusal("123", "a second rank's copy")  # the first one stays
    note = notes / "dspark-refusal-123"
    assert stat.S_IMODE(note.stat().st_mode) == 0o600
    with pytest.raises(ValueError) as caught:
        refusal.raise_recorded_refusal("123")
    assert str(caught.value) == "DSpark refused the configuration: k=9 exceeds 7. Use k <= 7."
    assert caught.value.__suppress_context__
    assert not note.exists()
    refusal.raise_recorded_refusal("123")  # nothing left: returns


def test_a_data_parallel_rank_is_found_and_other_engines_are_not(notes):
    refusal.record_refusal("1234", "another engine's refusal")
    refusal.record_refusal("12_dp1", "rank 1 refused")
    with pytest.raises(ValueError, match="rank 1 refused"):
        refusal.raise_recorded_refusal("12")
    assert (notes / "dspark-refusal-1234").exists()


def test_links_are_never_followed(notes):
    victim = notes / "victim"
    victim.write_text("kept")
    (notes / "dspark-refusal-7").symlink_to(victim)
    refusal.record_refusal("7", "written through a link")
    refusal.raise_recorded_refusal("7")  # a link is not a note: nothing raised
    assert victim.read_text() == "kept"


def test_an_in_process_engine_records_nothing(notes, monkeypatch):
    """Its frontend sees the proposer's own exception."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    refusal.record_refusal("5", "refused")
    assert os.listdir(notes) == []
