# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The tiny test checkpoints look trained: several layers, and norm weights that
are neither one nor copies of another layer's.

A kernel that applies one layer's norm to another layer's rows (vLLM's stacked
context K-norm on CPU) is invisible on checkpoints whose norms are all one or
all alike; this test names any checkpoint the builders write that would hide it.
"""

import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dspark_fixtures.checkpoints import gemma4, qwen3

_LAYER_NORM = re.compile(r"^(?P<head>.*\blayers\.)(?P<index>\d+)(?P<tail>\..*norm[^.]*\.weight)$")


def untrained_norms(weights: dict[str, torch.Tensor]) -> list[str]:
    """Why these weights do not look trained: norms that are all one, per-layer
    norms equal to another layer's, fewer than two layers."""
    problems = []
    by_kind: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    for name, weight in weights.items():
        if not re.search(r"norm[^.]*\.weight$", name):
            continue
        if bool(torch.all(weight == 1)):
            problems.append(f"{name} is all ones")
        if match := _LAYER_NORM.match(name):
            by_kind[match["head"] + "*" + match["tail"]][int(match["index"])] = weight
    layers = {i for per_layer in by_kind.values() for i in per_layer}
    if len(layers) < 2:
        problems.append(f"{len(layers)} layer(s)")
    for kind, per_layer in by_kind.items():
        indices = sorted(per_layer)
        problems += [
            f"{kind}: layers {a} and {b} are equal"
            for n, a in enumerate(indices)
            for b in indices[n + 1 :]
            if torch.equal(per_layer[a], per_layer[b])
        ]
    return problems


def _qwen3_checkpoints(root: Path) -> dict[str, Path]:
    spec = qwen3.DSparkDraftSpec()
    bigram_spec = qwen3.DSparkDraftSpec(
        markov_rank=qwen3.HIDDEN_SIZE, confidence_head=True, confidence_with_markov=True
    )
    targets = {
        kind: qwen3.build_qwen3_target(root / f"target-{kind}", kind=kind)
        for kind in qwen3.TARGET_KINDS
    }
    return {
        **{f"qwen3 target ({kind})": path for kind, path in targets.items()},
        "qwen3 dspark draft (random)": qwen3.save_dspark_draft(
            root / "random", spec, target=targets["random"]
        ),
        "qwen3 dspark draft (oracle)": qwen3.save_dspark_draft(
            root / "oracle", spec, qwen3.oracle_dspark_weights(spec), targets["zero-lm-head"]
        ),
        "qwen3 dspark draft (bigram, confidence head)": qwen3.save_dspark_draft(
            root / "bigram",
            bigram_spec,
            qwen3.bigram_dspark_weights(bigram_spec, targets["bigram"]),
            targets["bigram"],
        ),
        "qwen3 dspark draft (dflash layout)": qwen3.save_dspark_draft(
            root / "dflash-layout", qwen3.DSparkDraftSpec(layout="dflash")
        ),
        "qwen3 dflash draft": qwen3.save_dflash_draft(
            root / "dflash", spec, qwen3.random_dspark_weights(spec)
        ),
    }


def _gemma4_checkpoints(root: Path) -> dict[str, Path]:
    spec = gemma4.Gemma4DraftSpec()
    bigram_spec = gemma4.Gemma4DraftSpec(markov_rank=qwen3.HIDDEN_SIZE)
    targets = {
        kind: gemma4.build_gemma4_target(root / f"target-{kind}", kind=kind)
        for kind in gemma4.GEMMA4_TARGET_KINDS
    }
    return {
        **{f"gemma4 target ({kind})": path for kind, path in targets.items()},
        "gemma4 dspark draft (random)": gemma4.save_gemma4_draft(
            root / "random", spec, targets["random"]
        ),
        "gemma4 dspark draft (oracle)": gemma4.save_gemma4_draft(
            root / "oracle",
            spec,
            targets["zero-norm"],
            gemma4.oracle_gemma4_draft_weights(spec),
        ),
        "gemma4 dflash draft (benchmark)": gemma4.save_gemma4_dflash_draft(root / "dflash", spec),
        "gemma4 dspark draft (bigram)": gemma4.save_gemma4_draft(
            root / "bigram",
            bigram_spec,
            targets["bigram"],
            gemma4.bigram_gemma4_draft_weights(bigram_spec, targets["bigram"]),
        ),
    }


BUILDERS: dict[str, Callable[[Path], dict[str, Path]]] = {
    "qwen3": _qwen3_checkpoints,
    "gemma4": _gemma4_checkpoints,
}


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_every_tiny_checkpoint_has_trained_looking_norms(tmp_path, family):
    from safetensors.torch import load_file

    problems = {
        name: found
        for name, path in BUILDERS[family](tmp_path).items()
        if (found := untrained_norms(load_file(str(path / "model.safetensors"))))
    }
    assert problems == {}


def test_the_check_names_a_checkpoint_with_copied_or_unit_norms():
    """The check has teeth: a draft whose second layer copies the first's norms,
    and a draft with unit norms, are both named."""
    weights = qwen3.random_dspark_weights(qwen3.DSparkDraftSpec())
    assert untrained_norms(weights) == []
    copied = dict(weights)
    copied["layers.1.self_attn.k_norm.weight"] = weights["layers.0.self_attn.k_norm.weight"]
    assert untrained_norms(copied) == ["layers.*.self_attn.k_norm.weight: layers 0 and 1 are equal"]
    unit = {**weights, "hidden_norm.weight": torch.ones(qwen3.HIDDEN_SIZE)}
    assert untrained_norms(unit) == ["hidden_norm.weight is all ones"]
    one_layer = qwen3.random_dspark_weights(qwen3.DSparkDraftSpec(num_layers=1))
    assert untrained_norms(one_layer) == ["1 layer(s)"]
