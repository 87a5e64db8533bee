# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""What the patched tree imports: a plain engine (no speculative decoding) no overlay module,
and a Qwen3 DSpark engine no module of the DeepSeek-V4 draft. Each engine runs in a fresh
interpreter (in-process engine core), which reports the overlay modules it imported."""

import json
import subprocess
import sys
from pathlib import Path

OVERLAY = Path(__file__).resolve().parents[2] / "overlay"
V4_DRAFT = ("vllm.v1.spec_decode.dspark.deepseek_v4", "vllm.v1.spec_decode.dspark.ring_proposer")

PROBE = """
import json, sys
from pathlib import Path
from dspark_fixtures.engine import dspark_config, run_engine, use_engine_env
use_engine_env()
target, draft, overlay = sys.argv[1:4]
spec = dspark_config(Path(draft)) if draft else None
run_engine(Path(target), ["w1 w2 w3"], 4, spec, max_num_seqs=1)
names = {
    ".".join(p.relative_to(overlay).with_suffix("").parts).removesuffix(".__init__")
    for p in Path(overlay).rglob("*.py")
}
print("OVERLAY-MODULES", json.dumps(sorted(names & set(sys.modules))))
"""


def overlay_modules_imported(target: Path, draft: Path | None) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(target), str(draft or ""), str(OVERLAY)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("OVERLAY-MODULES")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    return json.loads(lines[-1].split(" ", 1)[1])


def test_a_plain_engine_imports_no_overlay_module(tiny):
    assert overlay_modules_imported(tiny.random_target, None) == []


def test_a_qwen3_dspark_engine_imports_no_module_of_the_v4_draft(tiny):
    imported = overlay_modules_imported(tiny.random_target, tiny.random_draft)
    assert "vllm.v1.spec_decode.dspark.paged_proposer" in imported  # the probe sees the overlay
    assert [name for name in imported if name.startswith(V4_DRAFT)] == []
