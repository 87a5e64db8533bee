# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The profile's flag guard agrees with vLLM's own `vllm serve` parser: every spelling that
parser resolves to a managed flag (prefix abbreviations, short options, `=value`, underscores,
`--flag.key`, `-cc.key` and JSON inside `--compilation-config`) is refused, and no other option
vLLM defines is."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from dspark_launch import serving_flags
from dspark_launch.errors import ConfigError
from dspark_launch.profile import FLAG_ALIASES, MANAGED_FLAGS, load_profile, managed_flag
from tests.launch.launch_testlib import write_profile

pytestmark = pytest.mark.each_vllm  # each version's own serve parser


@pytest.fixture(scope="module")
def serve_parser() -> argparse.ArgumentParser:
    return serving_flags.serve_parser()


def vllm_resolves(parser: argparse.ArgumentParser, arg: str) -> argparse.Action | None:
    """The action vLLM's parser gives `arg`: its rewriting of `--names` (underscores to dashes,
    `--flag.key` to `--flag`) and then argparse's own option matching."""
    if arg.startswith("--"):
        key, sep, value = arg.partition("=")
        key = "--" + re.sub("_", "-", key[2:].split(".", 1)[0])
        arg = key + sep + value
    try:
        found = parser._parse_optional(arg)
    except SystemExit:  # ambiguous: vLLM refuses to start; the guard may refuse it too
        return None
    return found[0] if found else None


def spellings(option: str) -> list[str]:
    head = 2 if option.startswith("--") else 1
    prefixes = [option[:end] for end in range(head + 1, len(option) + 1)]
    variants = [f"{option}=1", option.replace("-", "_").replace("__", "--", 1)]
    if option.startswith("--"):
        variants.append(f"{option}.key")
    elif len(option) == 2:
        variants.append(f"{option}1")
    return prefixes + variants


def test_every_spelling_vllm_reads_as_a_managed_flag_is_refused(serve_parser, capsys):
    managed = {**{flag: flag for flag in MANAGED_FLAGS}, **FLAG_ALIASES}
    actions = {
        option: action for action in serve_parser._actions for option in action.option_strings
    }
    managed_actions = {id(actions[option]) for option in managed if option in actions}
    missing = [option for option in MANAGED_FLAGS if option not in actions]
    assert missing == [], f"vLLM no longer has {missing}"
    for action in serve_parser._actions:
        if id(action) in managed_actions:
            extra = set(action.option_strings) - set(managed)
            assert not extra, f"vLLM spells a managed flag {extra}: add it to FLAG_ALIASES"
    checked = 0
    for option in managed:
        for arg in spellings(option):
            action = vllm_resolves(serve_parser, arg)
            if action is not None and id(action) in managed_actions:
                assert managed_flag(arg), arg
                checked += 1
    capsys.readouterr()
    assert checked > 200, checked


def test_no_other_vllm_option_is_refused(serve_parser):
    managed = {**{flag: flag for flag in MANAGED_FLAGS}, **FLAG_ALIASES}
    actions = {
        option: action for action in serve_parser._actions for option in action.option_strings
    }
    managed_actions = {id(actions[option]) for option in managed if option in actions}
    others = [o for o, action in actions.items() if id(action) not in managed_actions]
    assert len(others) > 300
    wrongly = [o for o in others if managed_flag(o) or managed_flag(f"{o}=1")]
    assert wrongly == []


CAPTURE = '{"max_cudagraph_capture_size": 36}'
# Every way vLLM's parser takes the capture maximum the launcher leaves to vLLM's default.
CAPTURE_SPELLINGS = [
    ["--max-cudagraph-capture-size=36"],
    ["--max_cudagraph_capture_size", "36"],
    ["--compilation-config", CAPTURE],
    [f"--compilation-config={CAPTURE}"],
    [f"--compilation_config={CAPTURE}"],
    [f"--comp={CAPTURE}"],
    ["-cc", CAPTURE],
    [f"-cc={CAPTURE}"],
    ["-cc.max_cudagraph_capture_size=36"],
    ["-cc.max_cudagraph_capture_size", "36"],
    ["--compilation-config.max_cudagraph_capture_size=36"],
    ["--compilation_config.max_cudagraph_capture_size", "36"],
]
SPECULATIVE_SPELLINGS = [
    ["--speculative-config", '{"method": "ngram"}'],
    ['-sc={"method": "ngram"}'],
    ["-sc.method=ngram"],
    ["--speculative_config.method", "ngram"],
]


def guard(tmp_path: Path, serve_args: list[str]) -> str | None:
    """The launcher's one-line refusal of a profile with `serve_args`, else None."""
    path = write_profile(tmp_path / "p.yaml", serve_args=serve_args)
    try:
        load_profile(path)
    except ConfigError as error:
        return str(error)
    return None


@pytest.mark.parametrize("spelling", CAPTURE_SPELLINGS, ids=" ".join)
def test_capture_maximum_in_every_spelling_is_refused(serve_parser, tmp_path, spelling):
    read = serve_parser.parse_args(["m", *spelling])
    compilation = read.compilation_config
    assert 36 in (read.max_cudagraph_capture_size, compilation.max_cudagraph_capture_size)
    refused = guard(tmp_path, spelling)
    assert refused and "\n" not in refused, refused
    assert "which the launcher sets from (left to vLLM's default" in refused


@pytest.mark.parametrize("spelling", SPECULATIVE_SPELLINGS, ids=" ".join)
def test_speculative_config_in_every_spelling_is_refused(serve_parser, tmp_path, spelling):
    assert serve_parser.parse_args(["m", *spelling]).speculative_config is not None
    refused = guard(tmp_path, spelling)
    assert refused and "which the launcher sets from speculative" in refused, refused


@pytest.mark.parametrize(
    "spelling",
    [
        ["-cc.cudagraph_capture_sizes=[6,12]"],  # vLLM reads it; the profile may set it
        ["--compilation-config", '{"cudagraph_capture_sizes": [6, 12]}'],
        # vLLM 0.32/0.33 read `-O.x` as an optimisation level, not a compilation key.
        ["-O.max_cudagraph_capture_size=36"],
    ],
    ids=" ".join,
)
def test_compilation_keys_the_launcher_does_not_own_pass(serve_parser, tmp_path, spelling):
    read = serve_parser.parse_args(["m", *spelling])
    assert read.compilation_config.max_cudagraph_capture_size is None
    assert guard(tmp_path, spelling) is None


def test_a_mistyped_flag_is_named_with_vllms_closest_one():
    with pytest.raises(serving_flags.FlagError) as caught:
        serving_flags.parse_serve_args(["--enable-prefix-cacheing", "--block-size=256"])
    assert str(caught.value) == (
        "vLLM's serve parser: vllm serve: error: unrecognized arguments: "
        "--enable-prefix-cacheing; closest vLLM flag: --enable-prefix-cacheing -> "
        "--enable-prefix-caching"
    )
