# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The serving-flag check (`dspark_launch/serving_flags.py`) against vLLM's own rules: the Spark
profile's rendered head command against a tiny `config.json` of each quantisation the
DeepSeek-V4 family ships, run as the launcher runs it (the file piped to `python3 -`).

The old profile flag (`--moe-backend=flashinfer_b12x`, NVFP4-only) must fail for MXFP4 experts:
`test_the_previous_spark_backend_is_refused_for_mxfp4` is the control that shows the check can
fail on exactly the profile this issue found broken.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_fixtures.deepseek_v4_flash import V4_FLASH_CONFIG, V4_FP8_LINEARS
from dspark_launch import serving_flags
from dspark_launch.profile import PROFILES_DIR, load_profile
from dspark_launch.shell import bundled
from tests.helpers import VLLM_SOURCES

SPARK = PROFILES_DIR / "deepseek-v4-flash-2x-spark.yaml"
# The published DeepSeek-V4-Flash fields the check reads.
V4_BASE = {key: V4_FLASH_CONFIG[key] for key in ("architectures", "model_type", "n_routed_experts")}
FP8_LINEARS = V4_FP8_LINEARS
CHECKPOINTS = {
    "mxfp4": {**V4_BASE, "expert_dtype": "fp4", "quantization_config": FP8_LINEARS},
    "nvfp4": {
        **V4_BASE,
        "expert_dtype": "fp4",
        "quantization_config": {**FP8_LINEARS, "moe_quant_algo": "NVFP4"},
    },
    "fp8": {
        **V4_BASE,
        "expert_dtype": "fp8",
        "quantization_config": {**FP8_LINEARS, "scale_fmt": None},
    },
    "unquantized": {**V4_BASE, "expert_dtype": "bf16"},
}


def spark_head_args(**replace_flags: str) -> list[str]:
    """The serve args the head renders for the Spark profile, with `--flag=value` swapped in."""
    profile = load_profile(SPARK)
    args = [profile.model, "--kv-cache-dtype", profile.kv_cache_dtype, *profile.serve_args]
    for flag, value in replace_flags.items():
        option = "--" + flag.replace("_", "-")
        args = [a for a in args if not a.startswith(option + "=")] + [f"{option}={value}"]
    return args


def run_check(tmp_path: Path, config: dict, args: list[str]) -> tuple[int, dict]:
    """As the launcher runs it: the file piped to `python3 - CONFIG ARGS...`, JSON on stdout."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, "-", str(path), *args],
        input=bundled(Path(serving_flags.__file__)),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout must be one JSON line:\n{done.stdout}\n{done.stderr[-2000:]}"
    return done.returncode, json.loads(lines[0])


def check(config: dict, args: list[str]) -> tuple[int, dict]:
    """The same check in this process (vLLM imported once), answering as `main` does."""
    try:
        return 0, serving_flags.check(config, args)
    except serving_flags.FlagError as e:
        return 1, {"ok": False, "detail": str(e)}


@pytest.mark.multiproc  # vLLM's own check, imported in a subprocess
def test_the_spark_profile_is_accepted_for_what_its_checkpoint_ships(tmp_path):
    rc, answer = run_check(tmp_path, CHECKPOINTS["mxfp4"], spark_head_args())
    assert (rc, answer["ok"]) == (0, True), answer
    assert (answer["quantization"], answer["experts"]) == ("deepseek_v4_fp8", "mxfp4")


@pytest.mark.multiproc  # vLLM's own check, imported in a subprocess
def test_the_previous_spark_backend_is_refused_for_mxfp4(tmp_path):
    rc, answer = run_check(
        tmp_path, CHECKPOINTS["mxfp4"], spark_head_args(moe_backend="flashinfer_b12x")
    )
    assert (rc, answer["ok"]) == (1, False)
    assert "--moe-backend=flashinfer_b12x is refused" in answer["detail"]
    assert "MXFP4" in answer["detail"] and "map_mxfp4_backend" in answer["detail"]
    assert "Expected one of" in answer["detail"] and "'marlin'" in answer["detail"]


@pytest.mark.parametrize(
    ("kind", "accepted", "refused"),
    [
        ("nvfp4", "flashinfer_b12x", "deep_gemm"),
        ("fp8", "deep_gemm", "b12x"),
        ("unquantized", "triton", "deep_gemm"),
    ],
)
def test_each_expert_format_goes_through_its_own_oracle(kind, accepted, refused):
    config = CHECKPOINTS[kind]
    rc, answer = check(config, spark_head_args(moe_backend=accepted))
    assert (rc, answer["experts"]) == (0, kind), answer
    rc, answer = check(config, spark_head_args(moe_backend=refused))
    assert rc == 1 and f"--moe-backend={refused} is refused" in answer["detail"], answer


@pytest.mark.each_vllm  # 0.32.0's parser refuses the dtype, 0.33.0's CacheConfig
def test_kv_cache_dtype_and_quantization_go_through_vllm():
    rc, answer = check(CHECKPOINTS["mxfp4"], spark_head_args(kv_cache_dtype="nvfp4_dsmla"))
    # vLLM 0.32.0's parser refuses it ("invalid choice"), 0.33.0's CacheConfig ("Invalid").
    assert rc == 1 and "--kv-cache-dtype: " in answer["detail"], answer
    assert "'nvfp4_dsmla'" in answer["detail"] and "nvfp4_ds_mla" in answer["detail"]
    # A quantisation flag that contradicts the checkpoint: vLLM's own mismatch error.
    dense = {"model_type": "qwen3", "quantization_config": {"quant_method": "fp8"}}
    rc, answer = check(dense, ["m", "--quantization=bitsandbytes"])
    assert rc == 1 and "does not match the quantization method" in answer["detail"], answer
    rc, answer = check(dense, ["m"])
    assert (rc, answer["quantization"], answer["experts"]) == (0, "fp8", None), answer


@pytest.mark.parametrize("kind", ["missing", "a FIFO", "a directory"])
def test_an_unreadable_config_is_a_failure(tmp_path, kind):
    """As the launcher ships it (with the module it imports), outside the repository; a FIFO
    must not hang it."""
    config = tmp_path / "config.json"
    if kind == "a FIFO":
        os.mkfifo(config)
    elif kind == "a directory":
        config.mkdir()
    done = subprocess.run(
        [sys.executable, "-I", "-", str(config), "m"],
        input=bundled(Path(serving_flags.__file__)),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr
    detail = json.loads(done.stdout)["detail"]
    said = "does not exist" if kind == "missing" else f"is {kind}, not a regular file"
    assert detail == f"cannot read the checkpoint's config.json: {config}: {said}"


def test_the_deepseek_v4_expert_rules_mirror_vllms_source():
    """experts_format restates DeepseekV4FP8Config.get_quant_method's keys; fail on drift."""
    for tree in VLLM_SOURCES.values():
        text = (tree / "models" / "deepseek_v4" / "quant_config.py").read_text()
        assert 'getattr(hf_config, "expert_dtype", "fp4")' in text, tree
        assert 'quant_cfg.get("moe_quant_algo")' in text, tree
        assert 'self.moe_quant_algo == "NVFP4"' in text, tree
