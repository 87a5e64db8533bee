# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""What an operator's files and values can do to the launcher: special files given as the site
file, the profile or a secret (a FIFO must not hang it, a device or a huge file must not be read
whole), text from a file that would speak for the program (a line break and "ok: all checks
passed" in a key), and `serve_args` flags that make vLLM's parser print and exit."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from test_validation import _site

from dspark_common.operator_input import MAX_PATH_SHOWN, NotReadable, escaped, read_regular, shown
from dspark_launch.profile import exiting_flag
from dspark_launch.site import MAX_SECRET_BYTES
from tests.launch.launch_testlib import FAKES, write_profile, write_yaml

# A line break, a terminal escape that clears the line, and the program's own verdict after it;
# then every other kind of line break and two more control characters.
EVIL = "x\n\x1b[2K\rok: all checks passed\u2028\x85\t\x07"


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail instead of hanging (a FIFO opened for reading waits for a writer)."""

    def expire(signum, frame):
        raise TimeoutError(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def special(tmp_path: Path, kind: str) -> Path:
    """A path that is not a regular file, of `kind`."""
    path = tmp_path / kind.replace(" ", "-")
    if kind == "a FIFO":
        os.mkfifo(path)
    elif kind == "a directory":
        path.mkdir()
    elif kind == "a character device":
        return Path("/dev/null")
    elif kind == "a loop of symlinks":
        path.symlink_to(tmp_path / "other")
        (tmp_path / "other").symlink_to(path)
    return path


SPECIAL = ("a FIFO", "a directory", "a character device", "a loop of symlinks")


@pytest.fixture
def refused(tmp_path, cli, monkeypatch):
    """Run `--dry-run preflight` on a site (a dict, or a path): expect exit 2 with one printable
    line on stderr, nothing on stdout, within seconds; return that line."""
    monkeypatch.setenv("PATH", f"{FAKES}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))

    def run(site: dict | Path) -> str:
        path = site if isinstance(site, Path) else write_yaml(tmp_path / "site.yaml", site)
        with deadline(20):
            result = cli("--site", path, "--dry-run", "preflight")
        assert (result.rc, result.out) == (2, ""), result.err
        assert result.err.endswith("\n") and result.err.count("\n") == 1, repr(result.err)
        line = result.err[:-1]
        assert line.isprintable(), repr(line)
        assert line.startswith("dspark-launch preflight: "), line
        return line

    return run


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_site_file_that_is_not_a_file_is_named_for_what_it_is(tmp_path, refused, kind):
    path = special(tmp_path, kind)
    assert refused(path) == f"dspark-launch preflight: {path}: is {kind}" + (
        "" if kind == "a loop of symlinks" else ", not a regular file"
    )


@pytest.mark.parametrize("kind", (*SPECIAL, "missing"))
def test_a_profile_that_is_not_a_file_is_named_for_what_it_is(tmp_path, refused, kind):
    site = _site(tmp_path)
    site["profile"] = str(tmp_path / "missing" if kind == "missing" else special(tmp_path, kind))
    said = "does not exist (see recipe/profiles/" if kind == "missing" else f"is {kind}"
    assert f"profile {site['profile']} {said}" in refused(site)


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_secret_file_that_is_not_a_file_is_named_for_what_it_is(tmp_path, refused, kind):
    site = _site(tmp_path)
    site["secrets"] = {"api_key_file": str(special(tmp_path, kind))}
    line = refused(site)
    assert (
        f"secrets.api_key_file: cannot read it: {site['secrets']['api_key_file']}: is {kind}"
        in line
    )


def test_a_huge_secret_file_is_not_read_whole(tmp_path, refused):
    token = tmp_path / "token"
    token.write_bytes(b"t" * (MAX_SECRET_BYTES + 1))
    token.chmod(0o600)
    site = _site(tmp_path)
    site["secrets"] = {"hf_token_file": str(token)}
    assert f"larger than {MAX_SECRET_BYTES} bytes" in refused(site)


def test_a_socket_is_refused_without_reading(tmp_path):
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(tmp_path / "sock"))
        with pytest.raises(NotReadable, match=r"sock: is a socket$"):
            read_regular(tmp_path / "sock", 10)


def test_a_symlink_to_a_file_is_read(tmp_path):
    (tmp_path / "file").write_text("a: 1\n")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    assert read_regular(tmp_path / "link", 10).data == b"a: 1\n"
    with pytest.raises(NotReadable, match="larger than 4 bytes"):
        read_regular(tmp_path / "link", 4)


# Text from a file or an argument, in every message that quotes it -----------------------------


def evil_site_and_profile(tmp_path: Path) -> tuple[dict, dict]:
    """A valid site and profile holding every kind of value and section the schema reads."""
    site = _site(tmp_path)
    secret = tmp_path / "token"
    secret.write_text("hf_x\n")
    secret.chmod(0o600)
    site |= {
        "api_bind": "0.0.0.0",
        "lane": "v1",
        "health": {"timeout_s": 60, "interval_s": 5},
        "secrets": {"hf_token_file": str(secret)},
        "nccl_passthrough": {"NCCL_IB_MERGE_NICS": "0"},
    }
    profile = yaml.safe_load(Path(site["profile"]).read_text()) | {
        "description": "walked",
        "dtype": "bfloat16",
        "kv_cache_dtype": "fp8",
        "speculative": {"method": "dspark", "num_speculative_tokens": 2, "draft_model": "o/d"},
        "start_order": "worker-first",
        "lanes": ["v1", "v2"],
        "v2_lane": {"adaptive_verification": False},
        "compute_capability": ["12.1"],
        "serve_args": ["--trust-remote-code"],
        "env": {"A_B": "1"},
    }
    return site, profile


def mutations(data: object, path: tuple = ()) -> Iterator[tuple[tuple, object]]:
    """Every place a file's text can reach the program: each value (a mapping's, a list's item)
    replaced by EVIL, and an EVIL key added to each mapping: (where, the file's new data)."""
    if isinstance(data, dict):
        yield (*path, "<new key>"), {**data, EVIL: 1}
        for key, value in data.items():
            yield (*path, key), {**data, key: EVIL}
            yield (*path, EVIL), {EVIL if k == key else k: v for k, v in data.items()}
            for where, changed in mutations(value, (*path, key)):
                yield where, {**data, key: changed}
    elif isinstance(data, list):
        for index, item in enumerate(data):
            yield (*path, index), [*data[:index], EVIL, *data[index + 1 :]]
            for where, changed in mutations(item, (*path, index)):
                yield where, [*data[:index], changed, *data[index + 1 :]]


def test_every_message_that_quotes_a_file_is_one_escaped_line(tmp_path, refused):
    site, profile = evil_site_and_profile(tmp_path)
    profile_path = Path(site["profile"])
    write_yaml(profile_path, profile, mode=0o644)
    walked = 0
    for where, changed in mutations(site):
        assert refused(changed), where
        walked += 1
    for where, changed in mutations(profile):
        write_yaml(profile_path, changed, mode=0o644)
        assert refused(site), where
        walked += 1
    assert walked > 100


def test_paths_from_the_operator_are_escaped(tmp_path, refused):
    """A site file's own path comes from the command line, and a relative profile path is read
    beside it; every value in the file is refused unless printable (the walk above)."""
    evil_dir = tmp_path / EVIL
    evil_dir.mkdir()
    site_path = write_yaml(evil_dir / "site.yaml", {**_site(tmp_path), "mode": "kubernetes"})
    assert f"preflight: {escaped(str(site_path))}: mode: must be one of" in refused(site_path)
    site_path = write_yaml(evil_dir / "site.yaml", {**_site(tmp_path), "profile": "p/gone.yaml"})
    assert f"profile {escaped(str(evil_dir / 'p' / 'gone.yaml'))} does not" in refused(site_path)


def test_escaped_keeps_one_printable_line_and_a_bound():
    text = escaped(EVIL * 100)
    assert text.isprintable() and len(text) == MAX_PATH_SHOWN and text.endswith("...")
    assert escaped("ok: \\n") == "ok: \\n"  # printable text, backslashes included, is kept
    assert shown("a\nb") == "'a\\nb'"


# serve_args flags that make vLLM's parser print and exit --------------------------------------


@pytest.mark.parametrize("arg", ["--help", "-h", "--hel", "--help=all", "-hx"])
def test_flags_that_print_and_exit_are_refused(tmp_path, refused, arg):
    site = _site(tmp_path)
    write_profile(Path(site["profile"]), serve_args=[arg])
    assert "serve_args: " in refused(site) and "print its help and exit" in refused(site)


@pytest.mark.parametrize("arg", ["--headless", "--host", "--hf-token", "-q", "--trust-remote-code"])
def test_other_flags_are_not_taken_for_help(arg):
    assert exiting_flag(arg) is None
