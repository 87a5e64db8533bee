# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The unit tier's guard fails a unit test that starts a vLLM engine, here or in a child process,
or imports vLLM in a child, even when the test swallows the error; an engine-tier test may, and
so may the child in which vLLM's model registry inspects an architecture."""

import subprocess
import sys
import textwrap

from tests.helpers import REPO

# Stand-ins for vLLM's engine modules: the guard wraps classes by module name, and importing the
# real ones costs seconds per process.
FAKE_VLLM = {
    "vllm/__init__.py": "",
    "vllm/entrypoints/__init__.py": "",
    "vllm/entrypoints/llm.py": "class LLM:\n    def __init__(self):\n        pass\n",
    "vllm/v1/__init__.py": "",
    "vllm/v1/engine/__init__.py": "",
    "vllm/v1/engine/core.py": "class EngineCore:\n    def __init__(self):\n        pass\n",
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/models/__init__.py": "",
    "vllm/model_executor/models/registry.py": "",
}

PLANTED = """
import subprocess
import sys

import pytest

FAKE = {fake!r}


def start_in_process():
    sys.path.insert(0, FAKE)
    from vllm.entrypoints.llm import LLM

    try:
        LLM()
    except RuntimeError:
        pass


def test_starts_an_engine_in_process():
    start_in_process()


def test_starts_an_engine_in_a_child():
    code = "from vllm.v1.engine.core import EngineCore; EngineCore()"
    subprocess.run([sys.executable, "-c", code], env={{"PYTHONPATH": FAKE}}, check=False)


def test_imports_vllm_in_a_child():
    code = "import vllm"
    subprocess.run([sys.executable, "-c", code], env={{"PYTHONPATH": FAKE}}, check=True)


def test_runs_vllms_model_registry_probe():
    command = [sys.executable, "-m", "vllm.model_executor.models.registry"]
    subprocess.run(command, env={{"PYTHONPATH": FAKE}}, check=True)


def test_starts_nothing():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.engine
def test_an_engine_tier_test_may_start_one():
    start_in_process()
"""


def test_a_unit_test_that_starts_an_engine_fails(tmp_path):
    fake = tmp_path / "fake"
    for name, text in FAKE_VLLM.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text)
    planted = tmp_path / "test_planted.py"
    planted.write_text(textwrap.dedent(PLANTED.format(fake=str(fake))))
    result = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider"),
            *("-q", "-rf", "-W", "ignore::pytest.PytestUnknownMarkWarning", str(planted)),
        ],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=False,
    )
    out = result.stdout
    assert "3 failed, 3 passed" in out, out + result.stderr
    assert "FAILED test_planted.py::test_starts_an_engine_in_process" in out
    assert "FAILED test_planted.py::test_starts_an_engine_in_a_child" in out
    assert "FAILED test_planted.py::test_imports_vllm_in_a_child" in out
    assert "LLM started" in out and "EngineCore started" in out
    assert "vllm imported in a subprocess" in out
