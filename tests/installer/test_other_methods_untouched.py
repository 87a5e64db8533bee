# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The install leaves other speculative methods alone: upstream DFlash and ngram give the
same greedy tokens with DSpark installed as on stock vLLM (the tree after --uninstall)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_fixtures.checkpoints import qwen3
from dspark_fixtures.engine import ENGINE_ENV
from installer.state import STATE_DIR
from tests.installer.installer_testlib import environment_tree

pytestmark = [pytest.mark.engine, pytest.mark.each_vllm]

# DFlash first: after ngram has imported numba, a second in-process engine
# fails in vLLM's Triton-override scan (docs/vllm-cpu-testing notes, section 6).
GENERATE = """
import importlib.util, json, sys
from dspark_fixtures.engine import run_engine
target, dflash = sys.argv[1], sys.argv[2]
prompts = ["w5 w6 w7 w5 w6 w7 w5 w6", "w10 w11 w12 w13 w10 w11 w12 w13 w10", "w300 w12 w999"]
configs = {
    "dflash": {"method": "dflash", "model": dflash, "num_speculative_tokens": 3},
    "ngram": {
        "method": "ngram", "num_speculative_tokens": 3,
        "prompt_lookup_min": 2, "prompt_lookup_max": 3,
    },
}
overlay = importlib.util.find_spec("vllm.v1.spec_decode.dspark_proposer")
result = {"dspark_installed": overlay is not None}
for name, config in configs.items():
    run = run_engine(target, prompts, 24, config, max_num_seqs=3)
    result[name] = {"token_ids": run.token_ids, "drafts": run.drafts}
print("RESULT " + json.dumps(result))
"""


def generate(tmp_path: Path, vllm_path: Path | None) -> dict:
    target = qwen3.build_qwen3_target(tmp_path / "target")
    spec = qwen3.DSparkDraftSpec()
    dflash = qwen3.save_dflash_draft(tmp_path / "dflash", spec, qwen3.random_dspark_weights(spec))
    project = str(Path(__file__).resolve().parents[2])
    paths = [str(vllm_path)] if vllm_path else []
    env = {**os.environ, **ENGINE_ENV, "PYTHONPATH": os.pathsep.join([*paths, project])}
    result = subprocess.run(
        [sys.executable, "-c", GENERATE, str(target), str(dflash)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def runnable_stock_tree(pristine: Path, destination: Path) -> Path:
    """The uninstalled sources plus the environment's compiled extensions and
    data files (which the installer never touches), hardlinked."""
    environment = environment_tree().root
    for tree in (pristine, environment):
        for source in (tree / "vllm").rglob("*"):
            relative = source.relative_to(tree)
            target = destination / relative
            skip = (
                not source.is_file()
                or target.exists()
                or "__pycache__" in relative.parts
                or relative.as_posix().startswith(STATE_DIR)
                or (tree == environment and source.suffix == ".py")
            )
            if not skip:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(source, target)
    return destination


def test_dflash_and_ngram_outputs_are_the_same_with_and_without_the_install(
    pristine_running: Path, tmp_path: Path
):
    installed = generate(tmp_path / "installed", None)
    stock = generate(tmp_path / "stock", runnable_stock_tree(pristine_running, tmp_path / "site"))
    assert installed.pop("dspark_installed") and not stock.pop("dspark_installed")
    for method in ("dflash", "ngram"):
        assert installed[method]["drafts"] > 0, method  # the method really speculated
        assert installed[method] == stock[method], method
