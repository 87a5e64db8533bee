# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""``python -m dspark_demo`` as a newcomer runs it: vLLM's logs kept off the terminal, outputs
as text, the pair and its measures explained, a speed line that says why it is not faster, the
pair kept for serving (``--save``, with a chat template), and one line, at once, when DSpark is
not installed in the Python's vLLM."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_demo.saved_pair import CHAT_TEMPLATE, save_problem

REPO = Path(__file__).resolve().parents[2]
PRISTINE_033 = REPO / ".cache" / "vllm-0.33.0"
VLLM_LOG_LINE = re.compile(r"^(\(\w+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d ")


def demo(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dspark_demo", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=900,
    )


@pytest.mark.multiproc  # the demo's engines, in a subprocess
def test_the_oracle_pair_explains_itself_and_is_kept_for_serving(tmp_path):
    saved = tmp_path / "pair"
    result = demo("--pair", "oracle", "--repeats", "1", "--max-tokens", "16", "--save", str(saved))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    out = result.stdout
    assert result.stderr == ""
    assert not [line for line in out.splitlines() if VLLM_LOG_LINE.match(line)]
    assert "acceptance per position: how often the target accepted" in out
    assert "tau: tokens the target emits per verification step" in out
    assert "\nplain   <unk> <unk> <unk>" in out and "\ndspark  <unk> <unk> <unk>" in out
    assert "(<unk> is token 0: the oracle target's zero output head" in out
    assert "outputs equal: yes, token for token (4 prompts x 16 tokens)" in out
    assert "acceptance per position: 1.00, 1.00, 1.00, 1.00" in out
    assert "tau: 5.00 tokens per verification step" in out
    assert re.search(r"per engine step: plain [\d.]+ tokens in [\d.]+ ms; dspark", out)
    joined = out.replace("\n  ", " ")
    assert re.search(r"a DSpark step yields [\d.]+x the tokens of a plain step but takes", joined)
    assert "this tiny draft has as many layers as the tiny target" in joined

    from transformers import AutoTokenizer

    target = saved / "target"
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    assert tokenizer.chat_template == CHAT_TEMPLATE
    chat = [{"role": "user", "content": "w5 w6"}, {"role": "user", "content": "w7"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == "w5 w6 w7"
    assert (saved / "draft" / "model.safetensors").is_file()
    assert f"vllm serve {target} --served-model-name tiny" in out
    assert f'"model": "{saved / "draft"}"' in out
    assert not list(tmp_path.glob(".pair.partial-*"))
    assert (
        save_problem(saved) == f"{saved} already holds a saved pair; serve it, or name a new folder"
    )


def test_help_names_the_command_and_its_defaults():
    result = demo("--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: python -m dspark_demo ")
    assert "(default: bigram)" in result.stdout and "(default: 5)" in result.stdout


def test_a_vllm_without_dspark_gets_one_line_at_once():
    if not (PRISTINE_033 / "vllm" / "__init__.py").is_file():
        pytest.skip(f"{PRISTINE_033} (an unpatched vLLM tree) is missing")
    result = demo(PYTHONPATH=str(PRISTINE_033))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        f"dspark_demo: DSpark is not installed in this Python's vLLM ({PRISTINE_033 / 'vllm'}: "
        f"not-installed). Run: {os.path.relpath(sys.executable, REPO)} install.py\n"
    )
