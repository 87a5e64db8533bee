# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""`tools/fatbin.py` against real binaries: the vLLM 0.33.0 wheel's own `.so` files, and
(where nvcc is installed) one nvcc builds here for every kind of target, so the flag bits the
reader decodes are checked against the compiler that writes them. Controls: a mutated magic, a
fat binary that claims more bytes than its section holds, an entry of an unknown kind and a cut
ELF file each fail with a message naming the offset."""

from __future__ import annotations

import shutil
import struct
import subprocess
import zipfile
from pathlib import Path

import pytest

from tools import fatbin

REPO = Path(__file__).resolve().parents[2]
WHEEL = REPO / ".cache" / "wheels" / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
SMALL = "vllm/_flashmla_extension_C.abi3.so"  # 220 kB: sm_90a and sm_100f machine code


def wheel_member(name: str) -> bytes:
    if not WHEEL.is_file():
        pytest.skip(f"{WHEEL.name} is missing: run scripts/setup-cpu-env.sh")
    with zipfile.ZipFile(WHEEL) as archive:
        return archive.read(name)


def fatbin_offset(data: bytes) -> int:
    """Where `.nv_fatbin` starts in the file."""
    return fatbin.elf_sections(data)[".nv_fatbin"][0]


def test_the_wheels_flashmla_extension_carries_hopper_and_blackwell_family_code():
    listing = fatbin.read(wheel_member(SMALL))
    assert (listing.sass, listing.ptx, len(listing.fatbins)) == (["sm_90a", "sm_100f"], [], 2)
    assert all(e.compressed for f in listing.fatbins for e in f.entries)
    assert fatbin.coverage(listing.as_json(), (10, 3)) == {fatbin.NATIVE: 2}  # 100f on B300
    assert fatbin.coverage(listing.as_json(), (12, 1)) == {fatbin.NONE: 2}


def test_a_host_library_carries_no_gpu_code():
    assert fatbin.read(wheel_member("vllm/cumem_allocator.abi3.so")).as_json()["fatbins"] == 0


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda data, at: data[:at] + b"\x51" + data[at + 1 :], "no fat binary magic at offset 0"),
        (
            lambda data, at: data[: at + 8] + struct.pack("<Q", 1 << 40) + data[at + 16 :],
            "claims 1099511627776 bytes",
        ),
        (lambda data, at: data[: at + 16] + b"\x07" + data[at + 17 :], "has kind 7"),
        (lambda data, at: data[: len(data) // 2], "section headers cut short"),
    ],
    ids=["magic", "size", "entry-kind", "cut-file"],
)
def test_a_damaged_binary_is_refused(mutate, message):
    data = wheel_member(SMALL)
    with pytest.raises(fatbin.FatbinError, match=message):
        fatbin.read(mutate(data, fatbin_offset(data)))


def test_the_cli_names_a_damaged_file_in_one_line(tmp_path, capsys):
    damaged = tmp_path / "damaged.so"
    data = wheel_member(SMALL)
    at = fatbin_offset(data)
    damaged.write_bytes(data[:at] + b"\0\0\0\x01" + data[at + 4 :])
    assert fatbin.main([str(damaged)]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


TARGETS = {
    "arch=compute_90a,code=sm_90a": "sm_90a",
    "arch=compute_100f,code=sm_100f": "sm_100f",
    "arch=compute_103,code=sm_103": "sm_103",
    "arch=compute_120,code=compute_120": "compute_120",
}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_what_nvcc_writes_is_read_back(tmp_path):
    """A fat binary with an entry for each kind of target (architecture-specific, family,
    plain SASS, PTX), compressed as nvcc's `size` mode does."""
    source = tmp_path / "k.cu"
    source.write_text("__global__ void k(float *x) { x[threadIdx.x] *= 2.f; }\n")
    gencodes = [arg for target in TARGETS for arg in ("-gencode", target)]
    output = tmp_path / "k.fatbin"
    subprocess.run(
        ["nvcc", "-fatbin", "--compress-mode=size", *gencodes, str(source), "-o", str(output)],
        check=True,
        capture_output=True,
    )
    (found,) = fatbin.walk(memoryview(output.read_bytes()), output.name)
    assert [e.arch for e in found.entries] == list(TARGETS.values())
    assert all(e.compressed for e in found.entries)
    # CUDA's rules on what was read: 90a only on 9.0, 100f across 10.x, plain PTX on later GPUs.
    verdict = fatbin.arch_verdict
    assert verdict(found.sass, found.ptx, (10, 3)) == fatbin.NATIVE
    assert verdict(found.sass, found.ptx, (9, 0)) == fatbin.NATIVE
    assert verdict(found.sass, found.ptx, (12, 1)) == fatbin.PTX_JIT
    assert verdict(found.sass, [], (12, 1)) == fatbin.NONE
    assert verdict(["sm_90a"], [], (10, 0)) == fatbin.NONE
    assert verdict([], ["compute_120a"], (12, 1)) == fatbin.NONE
