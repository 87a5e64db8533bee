# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Peak host memory of loading the DeepSeek-V4 DSpark draft, against its ``mtp.*`` bytes.

Writes the tiny V4 checkpoint (``dspark_fixtures/checkpoints/deepseek_v4.py``) scaled up by its
hidden and expert sizes into one safetensors file holding the target's tensors and the ``mtp.*``
draft, then loads the draft in a fresh process per way, side by side:

- ``streamed``: the proposer's path, ``checkpoint_draft_tensors`` (one tensor read at a time);
- ``dict``: the earlier path, every ``mtp.*`` tensor taken from vLLM's safetensors iterator
  into a dict first, then loaded.

Each process builds the draft on the CPU (its parameters are untouched, so not yet resident),
resets its peak resident set (``/proc/self/clear_refs``), loads, and reports the growth of the
peak (``VmHWM``) and the bytes its ``read`` calls returned (``rchar``). The draft's parameters
themselves take about the ``mtp.*`` bytes, so 1.0x is the floor.

    python -m benchmarks.deepseek_v4_load_rss --hidden-size 1024 --moe-intermediate-size 1536
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

GIB = 2**30
WAYS = ("streamed", "dict")


def _proc_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise KeyError("rchar")


def write_checkpoint(model_dir: Path, hidden_size: int, moe_intermediate_size: int) -> int:
    """The scaled tiny V4 checkpoint (bf16); returns its ``mtp.*`` bytes."""
    from dspark_fixtures.checkpoints import deepseek_v4 as tiny_v4

    config = {
        **tiny_v4.TINY_V4_CONFIG,
        "hidden_size": hidden_size,
        "moe_intermediate_size": moe_intermediate_size,
    }
    checkpoint = tiny_v4.random_v4_checkpoint(config)
    tiny_v4.save_v4_target(model_dir, checkpoint, config)
    return sum(t.numel() * 2 for name, t in checkpoint.items() if name.startswith("mtp."))


def measure(way: str, model_dir: Path) -> dict:
    """Load the draft one way in this process; the growth of its peak RSS and of its reads."""
    from dspark_fixtures.v4_draft import build_draft, v4_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import get_draft_load_config
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    from vllm.v1.spec_decode.dspark.deepseek_v4 import (
        checkpoint_draft_tensors,
        load_deepseek_v4_draft,
    )

    vllm_config = v4_vllm_config(model_dir)
    draft_config = vllm_config.speculative_config.draft_model_config
    model = build_draft(vllm_config)
    files = [str(model_dir / "model.safetensors")]
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    rss_before, rchar_before = _proc_kib("VmRSS"), _rchar()
    if way == "streamed":
        loader = get_model_loader(get_draft_load_config(vllm_config))
        weights = checkpoint_draft_tensors(loader, draft_config)
    else:
        weights = {
            name: tensor
            for name, tensor in safetensors_weights_iterator(files, use_tqdm_on_load=False)
            if name.startswith("mtp.")
        }
    load_deepseek_v4_draft(model, weights, draft_config.hf_config)
    peak = _proc_kib("VmHWM")
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "peak_growth": (peak - rss_before) * 1024,
        "read": _rchar() - rchar_before,
        "param_bytes": param_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--moe-intermediate-size", type=int, default=1536)
    parser.add_argument("--measure", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.model_dir)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "v4"
        mtp_bytes = write_checkpoint(model_dir, args.hidden_size, args.moe_intermediate_size)
        file_bytes = (model_dir / "model.safetensors").stat().st_size
        results = {}
        for way in WAYS:
            command = ["-m", "benchmarks.deepseek_v4_load_rss", "--measure", way]
            out = subprocess.run(
                [sys.executable, *command, "--model-dir", str(model_dir)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            results[way] = json.loads(out.strip().splitlines()[-1])
    print(
        f"tiny V4 checkpoint, hidden {args.hidden_size}, moe_intermediate "
        f"{args.moe_intermediate_size}: file {file_bytes / GIB:.2f} GiB, "
        f"mtp.* {mtp_bytes / GIB:.2f} GiB ({mtp_bytes:,d} bytes)"
    )
    print(f"  draft parameters: {results['streamed']['param_bytes'] / mtp_bytes:.3f}x mtp.*")
    for way in WAYS:
        r = results[way]
        print(
            f"  {way:<8s}: peak RSS growth {r['peak_growth'] / GIB:6.2f} GiB = "
            f"{r['peak_growth'] / mtp_bytes:.3f}x mtp.*; read() returned "
            f"{r['read'] / mtp_bytes:.3f}x mtp.*"
        )


if __name__ == "__main__":
    main()
