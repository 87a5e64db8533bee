# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The dry start's kernel report on the fat binaries of the vLLM 0.33.0 wheels the images
install: the wheel for each device's image, each library's verdict per device, and the refusal
of a library with no code for the device (a control: the real `_moe_C` with its Blackwell code
and PTX taken out)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from tools import fatbin
from tools.dry_start import kernels
from tools.dry_start.engine import Refused, Report, refusal

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / ".cache" / "wheels"


@pytest.fixture(scope="module")
def x86_64() -> kernels.KernelCode:
    code = kernels.image_wheel((12, 0), "0.33.0", WHEELS)
    if isinstance(code, str):
        pytest.skip(code)
    return code


def test_each_device_reads_the_wheel_of_its_image(tmp_path):
    assert "aarch64" in str(kernels.image_wheel((12, 1), "0.33.0", tmp_path))
    for capability in ((10, 0), (10, 3), (12, 0)):
        assert "x86_64" in str(kernels.image_wheel(capability, "0.33.0", tmp_path))
    assert "no Dockerfile" in str(kernels.image_wheel((9, 0), "0.33.0", tmp_path))


@pytest.mark.parametrize(
    ("library", "device", "verdict"),
    [
        (kernels.FLASH_ATTN[2], (12, 0), kernels.PTX_JIT),  # sm_80 code and compute_80 PTX only
        (kernels.FLASH_ATTN[2], (8, 0), kernels.NATIVE),
        (kernels.FLASH_ATTN[3], (12, 0), kernels.NO_CODE),  # sm_90a only
        (kernels.FLASHMLA, (10, 3), kernels.NATIVE),  # sm_100f runs across 10.x
        (kernels.FLASHMLA, (12, 1), kernels.NO_CODE),
        (kernels.CORE, (12, 1), kernels.NATIVE),  # sm_120 and sm_120f run on 12.1
        (kernels.MOE, (10, 3), kernels.NATIVE),
    ],
)
def test_library_verdicts_on_the_x86_64_wheel(x86_64, library, device, verdict):
    assert kernels.library_verdict(library, x86_64, device)[0] == verdict


def test_ptx_jit_names_the_ptx_the_driver_compiles(x86_64):
    _, detail = kernels.library_verdict(kernels.FLASH_ATTN[2], x86_64, (12, 0))
    assert "76 modules, 76 JIT-compiled from PTX" in detail and "650.0 MiB of PTX" in detail


def test_a_library_without_code_for_the_device_stops_the_start(x86_64):
    uses = [("experts_cls MarlinExperts", kernels.MOE), ("attention X", kernels.FLASHINFER)]
    report = Report(0)
    kernels.describe_kernels(report, uses, (12, 1), x86_64)
    assert [d.name for d in report.decisions] == ["read from", *(what for what, _ in uses)]
    # Control: the same wheel with _moe_C's Blackwell machine code and its PTX taken out.
    doctored = copy.deepcopy(x86_64.listing)
    member = kernels.MOE.find(doctored)
    for variant in doctored[member]["by_fatbin"]:
        variant["sass"] = [a for a in variant["sass"] if not a.startswith(("sm_10", "sm_12"))]
        variant["ptx"] = []
    with pytest.raises(kernels.NoKernelCode, match=r"sm_121 .* experts_cls MarlinExperts"):
        kernels.describe_kernels(Report(0), uses, (12, 1), kernels.KernelCode("x", doctored))


def test_a_wheel_that_is_not_there_is_said_not_refused(tmp_path):
    report = Report(0)
    kernels.describe_kernels(report, [], (12, 1), kernels.image_wheel((12, 1), "0.33.0", tmp_path))
    assert report.ok and "kernel code not read" in report.warnings[0]


def test_the_listing_is_the_readers(x86_64):
    """The cached listing agrees with a fresh read of a member."""
    member = "vllm/_qutlass_C.abi3.so"
    wheel = next(WHEELS.glob("vllm-0.33.0-*_x86_64.whl"))
    assert fatbin.read_wheel(wheel, [member])[member].as_json() == x86_64.listing[member]


def test_the_refusal_is_one_line_with_the_fix():
    error = kernels.NoKernelCode("no GPU code for sm_121 in the image for attention X (...)")
    found = refusal(Refused("kernels", error))
    assert (found.step, found.fix) == ("kernels", kernels.NoKernelCode.fix)
    assert "\n" not in found.message
