# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The V4 engine tests on vLLM's AVX2 extension, as an AVX2-only CI host runs them.

A subprocess makes torch's CPU-feature checks report an AVX2-only CPU before vLLM loads its
kernels, so ``CpuPlatform.import_kernels`` loads ``_C_AVX2`` (no DeepSeek-V4 ops) and every other
reader of those flags takes its AVX2 branch; the session fixture then installs the C++ stand-ins
and the engine cases run on them.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark_fixtures import cpp_standins

ROOT = Path(__file__).resolve().parents[2]
ENGINE_CASES = [
    "tests/engine_v4/test_v4_engine.py::test_oracle_draft_reads_its_ring_and_every_draft_is_accepted",
    "tests/engine_v4/test_v4_engine.py::test_wrong_rope_phase_gets_nothing_accepted",
]
# AVX2 without AVX-512 (nor its VNNI and BF16 extensions) or AMX.
AS_AN_AVX2_HOST = """
import json, sys
import torch
for flag in ("avx512", "avx512_bf16", "vnni", "amx_tile", "amx_fp16"):
    setattr(torch.cpu, f"_is_{flag}_supported", lambda: False)
import pytest
rc = pytest.main(sys.argv[1:])
from dspark_fixtures import cpp_standins
maps = open("/proc/self/maps").read()
report = dict(
    rc=int(rc),
    installed=cpp_standins.INSTALLED,
    avx2_extension="vllm/_C_AVX2.abi3.so" in maps,
    avx512_extension="vllm/_C.abi3.so" in maps,
)
print("AVX2-REPORT " + json.dumps(report))
"""


@pytest.mark.skipif(
    not torch.cpu._is_avx512_supported(),
    reason="this CPU is AVX2-only: every V4 engine test of the suite runs on _C_AVX2 itself",
)
def test_v4_engine_cases_pass_on_the_avx2_extension():
    """The oracle (DSpark output equal to plain decoding, every draft accepted) and the RoPE-phase
    control pass on ``_C_AVX2`` with every DeepSeek-V4 op stood in for: they run, not skip."""
    run = subprocess.run(
        [sys.executable, "-c", AS_AN_AVX2_HOST, "-q", "-p", "no:cacheprovider", *ENGINE_CASES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    output = run.stdout + run.stderr
    (line,) = [line for line in run.stdout.splitlines() if line.startswith("AVX2-REPORT ")]
    report = json.loads(line.removeprefix("AVX2-REPORT "))
    assert report == dict(
        rc=0,
        installed=list(cpp_standins.DEEPSEEK_V4_CPP_OPS),
        avx2_extension=True,
        avx512_extension=False,
    ), output[-4000:]
    assert f"{len(ENGINE_CASES)} passed" in output and "skipped" not in output, output[-4000:]
