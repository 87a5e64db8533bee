# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The commands of README.md and docs/dgx-spark.md that a CPU box can run do run, as written.

A fenced ``bash`` block is marked runnable by the line before its fence: ``<!-- cpu -->``, or
``<!-- cpu: NAME=value ... -->`` to give values that exist only on the real machines (an image
ID). Each document's runnable blocks run in order in one bash session (``set -euo pipefail``)
from the repository root, with ``HOME`` a fresh directory and ``.venv/bin`` first on ``PATH``
(so ``python`` is the patched environment's). Commands that would change a machine or serve
run as their dry runs (``DRY_RUNS``); a block that starts a server or needs a GPU, Docker or
the other node is left unmarked.
"""

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/dgx-spark.md")
MARKER = re.compile(r"^<!-- cpu(?::(?P<env>[^>]*))? -->$")
DRY_RUNS = (
    # The launcher's actions: every command they would run, printed, none run.
    (
        re.compile(r"(launch/dspark-launch)\b(?!.*--dry-run)(?=.*\b(start|stop|preflight)\b)"),
        r"\1 --dry-run",
    ),
    # An install or upgrade: every change it would make, printed, none made.
    (re.compile(r"(install\.py)(?![^#]*--(status|dry-run|help))"), r"\1 --dry-run"),
    # The suite itself is what CI runs; here, that it collects.
    (re.compile(r"(-m pytest)\b"), r"\1 --collect-only -q"),
    # The demo's options, parsed (tests/engine/test_demo.py runs it).
    (
        re.compile(r"^(?P<command>.*-m dspark_demo\b[^#]*?)(?P<comment>\s*#.*)?$"),
        r"\g<command> --help\g<comment>",
    ),
)


@dataclass(frozen=True)
class Block:
    line: int
    """Line number of the fence."""
    env: dict[str, str]
    text: str


def runnable_blocks(markdown: str) -> list[Block]:
    lines = markdown.splitlines()
    blocks = []
    for index, line in enumerate(lines[:-1]):
        marker = MARKER.match(line.strip())
        if not marker:
            continue
        fence = lines[index + 1]
        assert fence.startswith("```bash"), f"line {index + 2}: the marker must precede ```bash"
        end = lines.index("```", index + 2)
        env = dict(item.split("=", 1) for item in shlex.split(marker["env"] or ""))
        blocks.append(Block(index + 2, env, "\n".join(lines[index + 2 : end])))
    return blocks


def dry_run(text: str) -> str:
    for pattern, replacement in DRY_RUNS:
        text = "\n".join(pattern.sub(replacement, line) for line in text.splitlines())
    return text


def test_blocks_and_dry_runs_are_read_as_documented():
    markdown = (
        "text\n<!-- cpu -->\n```bash\npython install.py   # installs\n"
        "python install.py --status\nlaunch/dspark-launch --site s.yaml start\n```\n"
        "```bash\nnot marked\n```\n<!-- cpu: IMAGE=sha256:00 -->\n```bash\n"
        "launch/dspark-launch --site s.yaml --dry-run start\n.venv/bin/python -m pytest\n"
        ".venv/bin/python -m dspark_demo --pair oracle   # every draft accepted\n```\n"
    )
    first, second = runnable_blocks(markdown)
    assert (first.line, first.env, second.line, second.env) == (3, {}, 12, {"IMAGE": "sha256:00"})
    assert dry_run(first.text).splitlines() == [
        "python install.py --dry-run   # installs",
        "python install.py --status",
        "launch/dspark-launch --dry-run --site s.yaml start",
    ]
    assert dry_run(second.text).splitlines() == [
        "launch/dspark-launch --site s.yaml --dry-run start",
        ".venv/bin/python -m pytest --collect-only -q",
        ".venv/bin/python -m dspark_demo --pair oracle --help   # every draft accepted",
    ]


@pytest.mark.multiproc  # the commands import and run vLLM
@pytest.mark.parametrize("doc", DOCS)
def test_the_cpu_runnable_commands_run(doc, tmp_path):
    blocks = runnable_blocks((REPO / doc).read_text())
    if not blocks:
        pytest.skip(f"{doc} marks no block runnable on a CPU (<!-- cpu --> before ```bash)")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "HF_HUB_"))}
    env.update(HOME=str(home), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")
    script = ["set -euo pipefail"]
    for block in blocks:
        script.append(f"echo '### {doc}:{block.line}'")
        script.extend(f"export {name}={shlex.quote(value)}" for name, value in block.env.items())
        script.append(dry_run(block.text))
    result = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1200,
    )
    ran = re.findall(r"^### (\S+)$", result.stdout, re.MULTILINE)
    assert result.returncode == 0, f"the block at {ran[-1]} failed:\n{result.stdout[-4000:]}"
    assert len(ran) == len(blocks)
