# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The one bounded YAML reader (dspark_common/safe_yaml.py) and the installer's one-line refusals of
malformed pins, fault specs and journals."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_common.operator_input import MAX_SHOWN
from dspark_common.safe_yaml import MAX_BYTES, YamlError, load_mapping
from installer import pins as pins_module
from tests.installer.installer_testlib import REPO

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True)
)
HOSTILE = {
    "alias bomb": (BOMB.encode(), "once its aliases are expanded"),
    "recursive alias": (b"a: &a [*a]\n", "refers to a value that contains it"),
    "deep nesting": (b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested deeper than 32"),
    "deep mappings": (b"a: " + b"{b: " * 3000 + b"1" + b"}" * 3000 + b"\n", "nested deeper"),
    "not UTF-8": (b"a: \xff\xfe\n", "not valid UTF-8 at byte 3"),
    "a list": (b"[1, 2]\n", "must be a YAML mapping of keys to values, not a list"),
    "empty": (b"", "not an empty file"),
    "duplicate key": (b"a: 1\nb: 2\na: 3\n", "key 'a' appears twice: line 1 and line 3"),
    "duplicate key on one line": (b"a: {b: 1, b: 2}\n", "key 'b' appears twice: line 1 and line 1"),
    "too big": (b"a: '" + b"x" * MAX_BYTES + b"'\n", f"larger than {MAX_BYTES} bytes"),
    "byte-order mark": (b"\xef\xbb\xbfa: 1\n", "byte-order mark"),
    "CRLF": (b"a: 1\r\n", "carriage return"),
    "long duplicate key": (
        b"? " + b"k" * 5000 + b"\n: 1\n? " + b"k" * 5000 + b"\n: 2\n",
        "appears twice",
    ),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_yaml_is_one_bounded_line(tmp_path, name):
    data, message = HOSTILE[name]
    path = tmp_path / "config.yaml"
    path.write_bytes(data)
    with pytest.raises(YamlError) as caught:
        load_mapping(path)
    text = str(caught.value)
    assert text.startswith(f"{path}: ") and message in text
    assert "\n" not in text and len(text) < len(str(path)) + 300 + MAX_SHOWN


def test_anchors_that_stay_small_are_read(tmp_path):
    path = tmp_path / "site.yaml"
    path.write_text("node: &n {address: 10.0.0.1}\nhead: *n\nworker: *n\n")
    assert load_mapping(path)["worker"] == {"address": "10.0.0.1"}


def _project(tmp_path: Path, pins: str) -> Path:
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "pins.yaml").write_text(pins)
    return tmp_path


@pytest.mark.parametrize(
    ("pins", "message"),
    [
        ("schema: 1\noverlay: []\nversions: []\n", "versions must be a mapping"),
        ("schema: 1\noverlay: {a: 1}\nversions: {}\n", "overlay must be a list"),
        (
            "schema: 1\noverlay: []\nversions:\n  0.32.0: {distributions: vllm, patches: []}\n",
            "version 0.32.0 distributions must be a list",
        ),
        ("schema: 1\noverlay: " + "[" * 100 + "]" * 100 + "\n", "nested deeper"),
    ],
)
def test_malformed_pins_are_one_line(tmp_path, pins, message):
    with pytest.raises(pins_module.PinsError, match=message):
        pins_module.load(_project(tmp_path, pins))


def _install_py(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "install.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_a_malformed_fault_spec_is_a_usage_error():
    import os

    result = _install_py("--status", env={**os.environ, "DSPARK_INSTALL_FAIL_AT": "abc"})
    assert result.returncode == 2
    assert "DSPARK_INSTALL_FAIL_AT='abc': expected N:KIND" in result.stderr
    assert "Traceback" not in result.stderr


def test_status_json_answers_json_when_the_journal_is_corrupt(tree):
    state = tree / "vllm" / ".dspark-install"
    state.mkdir()
    (state / "journal.json").write_text("{not json")
    result = _install_py("--vllm-path", str(tree), "--status", "--json")
    answer = json.loads(result.stdout)
    assert answer["state"] == "error" and "journal.json is corrupt" in answer["error"]
    assert answer["exit_code"] == result.returncode != 0
    assert "Traceback" not in result.stderr


def test_status_into_a_closed_pipe_is_quiet():
    done = subprocess.run(
        f"{sys.executable} {REPO / 'install.py'} --status | head -c 1 >/dev/null",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "Broken pipe" not in done.stderr and "Traceback" not in done.stderr, done.stderr
