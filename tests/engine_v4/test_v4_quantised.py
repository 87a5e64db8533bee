# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The DeepSeek-V4 draft as V4-Flash ships it: FP8 block-scaled linears, MXFP4 routed experts.

The tiny V4 target and its ``mtp.*`` draft are quantised exactly as V4-Flash ships them
(``dspark_fixtures/checkpoints/deepseek_v4_quantised.py``) and served in the real engine twice: on
vLLM's own kernels (its CPU FP8 block linear and CPU MXFP4 MoE, both AMX; skipped without AMX),
and on the torch stand-ins
(``quant_standins.py``) with AMX reported off as vLLM's CPU path reads it
(``torch.cpu._is_amx_tile_supported()``, in this process, where the engine runs), which is what
a CPU without AMX runs. Their dequantised bf16 twin holds the same values unquantised.
Checked: the shipped formats decode, by vLLM's own helpers, to the twin's values; the loader
puts every code and scale where vLLM's layers read it and refuses a missing scale by name; DSpark
on the quantised checkpoint is lossless; the draft's MoE contributes; and the quantised draft
drafts what its twin drafts.
"""

import types

import pytest
import torch

from dspark_fixtures.checkpoints import deepseek_v4 as tiny_v4
from dspark_fixtures.checkpoints import deepseek_v4_quantised as quantise_v4
from dspark_fixtures.v4_draft import build_draft, v4_vllm_config
from tests.engine_v4.v4_harness import dspark, run_v4
from vllm.v1.spec_decode.dspark.deepseek_v4 import DSparkCheckpointError, load_deepseek_v4_draft

CONFIG = quantise_v4.QUANTISED_V4_CONFIG
TWIN_CONFIG = {key: value for key, value in CONFIG.items() if key != "quantization_config"}
K = 4
# A pair of distinct e8m0 scales with distinct transposes: 3 x 2 blocks of 128.
WEIGHT_SHAPE = (3 * 128 - 40, 2 * 128)

HAS_AMX = torch.cpu._is_amx_tile_supported()


@pytest.fixture(scope="module", params=["amx", "standins"])
def kernels(request):
    """vLLM's own AMX kernels, or the stand-ins with AMX reported off for the module's tests."""
    if request.param == "amx":
        if not HAS_AMX:
            pytest.skip("vLLM's CPU FP8 block linear and MXFP4 MoE need AMX tiles; none here")
        from dspark_fixtures.quant_standins import amx_moe_kernel_mismatch

        if reason := amx_moe_kernel_mismatch():
            pytest.skip(reason)
        yield request.param
        return
    from dspark_fixtures import quant_standins

    with quant_standins.amx_reported_off():
        yield request.param


def weight(seed: int, shape=WEIGHT_SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows of different magnitude, so every block and group gets its own scale.
    return torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[0])[:, None]


# --- The shipped formats ----------------------------------------------------------------------


def vllm_fp8_values(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """vLLM's dequantisation of an FP8 block-scaled weight (what its CPU DeepSeek-V4 attention
    applies to ``wo_a``)."""
    from vllm.models.deepseek_v4.cpu.cpu_sparse import _dequant_linear_weight

    layer = types.SimpleNamespace(
        weight=codes, weight_scale_inv=scale, weight_block_size=[128, 128]
    )
    return _dequant_linear_weight(layer)


def vllm_mxfp4_values(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """vLLM's dequantisation of MXFP4 expert weights (its FlashInfer MoE-EP fallback)."""
    from vllm.model_executor.layers.fused_moe.flashinfer_moe_ep import (
        _dequant_mxfp4_ue8m0_gran32,
    )

    return _dequant_mxfp4_ue8m0_gran32(packed, scale).float()


def test_fp8_blocks_decode_as_vllm_and_a_loop_decode_them():
    w = weight(0)
    codes, scale = quantise_v4.quantise_fp8_block(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert scale.shape == (3, 2)
    values = quantise_v4.dequantise_fp8_block(codes, scale)
    assert torch.equal(vllm_fp8_values(codes, scale), values)
    assert (values - w).norm() < 0.05 * w.norm()  # e4m3 keeps 3 mantissa bits
    # Wrong variants the checks catch: block scales transposed (column blocks first), a bias
    # of 126 instead of 127.
    transposed = scale.view(torch.uint8).T.contiguous().view(3, 2).view(torch.float8_e8m0fnu)
    assert not torch.equal(vllm_fp8_values(codes, transposed), values)
    off_bias = (scale.view(torch.uint8) + 1).view(torch.float8_e8m0fnu)
    assert not torch.equal(vllm_fp8_values(codes, off_bias), values)


def test_mxfp4_groups_decode_as_vllm_and_a_loop_decode_them():
    w = weight(1, (6, 128))
    packed, scale = quantise_v4.quantise_mxfp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (6, 64)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (6, 4)
    values = quantise_v4.dequantise_mxfp4(packed, scale)
    assert torch.equal(vllm_mxfp4_values(packed, scale), values)
    assert (values - w).norm() < 0.2 * w.norm()  # e2m1 keeps 1 mantissa bit
    swapped = ((packed.view(torch.uint8) >> 4) | (packed.view(torch.uint8) << 4)).view(torch.int8)
    assert not torch.equal(quantise_v4.dequantise_mxfp4(swapped, scale), values)
    off_bias = (scale.view(torch.uint8) + 1).view(torch.float8_e8m0fnu)
    assert not torch.equal(vllm_mxfp4_values(packed, off_bias), values)


def test_the_twin_holds_the_shipped_values():
    checkpoint = tiny_v4.random_v4_checkpoint(CONFIG)
    shipped, twin = quantise_v4.quantise_v4_checkpoint(checkpoint)
    fp8, fp4 = "mtp.1.attn.wq_b", "mtp.0.ffn.experts.63.w2"
    assert shipped[fp8 + ".weight"].dtype == torch.float8_e4m3fn
    assert shipped[fp4 + ".weight"].dtype == torch.int8
    assert torch.equal(
        twin[fp8 + ".weight"].float(),
        quantise_v4.dequantise_fp8_block(shipped[fp8 + ".weight"], shipped[fp8 + ".scale"]),
    )
    assert torch.equal(
        twin[fp4 + ".weight"].float(),
        quantise_v4.dequantise_mxfp4(shipped[fp4 + ".weight"], shipped[fp4 + ".scale"]),
    )
    assert set(twin) == {name for name in shipped if not name.endswith(".scale")}
    assert shipped["mtp.0.hc_attn_fn"].dtype == torch.float32
    assert shipped["mtp.0.ffn.gate.weight"].dtype == torch.bfloat16


# --- The loader -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped_checkpoint():
    return quantise_v4.quantise_v4_checkpoint(tiny_v4.random_v4_checkpoint(CONFIG))[0]


@pytest.fixture(scope="module")
def quantised_draft(tmp_path_factory, shipped_checkpoint, kernels):
    model_dir = tiny_v4.save_v4_target(
        tmp_path_factory.mktemp("v4q") / "target", shipped_checkpoint, CONFIG, keep_dtypes=True
    )
    vllm_config = v4_vllm_config(model_dir)
    return build_draft(vllm_config), vllm_config.speculative_config.draft_model_config.hf_config


def test_each_variant_runs_the_kernels_it_names(quantised_draft, kernels):
    from dspark_fixtures.quant_standins import TorchFp8BlockScaledMMKernel, TorchMxfp4Experts
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsMxfp4

    stage = quantised_draft[0].backbone.layers[0]
    linear = type(stage.attn.wq_b.quant_method.fp8_linear)
    experts = stage.ffn.experts.routed_experts.quant_method.experts_cls
    if kernels == "amx":
        assert (linear, experts) == (CPUFp8BlockScaledMMKernel, CPUExpertsMxfp4)
    else:
        assert (linear, experts) == (TorchFp8BlockScaledMMKernel, TorchMxfp4Experts)


def test_codes_and_scales_land_where_vllm_reads_them(quantised_draft, shipped_checkpoint):
    model, hf_config = quantised_draft
    load_deepseek_v4_draft(model, shipped_checkpoint, hf_config)
    params = dict(model.named_parameters())
    stage = "model.layers.1."
    ckpt = shipped_checkpoint
    linear = params[stage + "attn.wq_b.weight_scale_inv"]
    assert linear.dtype == torch.float8_e8m0fnu
    assert torch.equal(linear.view(torch.uint8), ckpt["mtp.1.attn.wq_b.scale"].view(torch.uint8))
    wkv_scale = params[stage + "attn.fused_wqa_wkv.weight_scale_inv"].view(torch.uint8)
    want = torch.cat([ckpt["mtp.1.attn.wq_a.scale"], ckpt["mtp.1.attn.wkv.scale"]])
    assert torch.equal(wkv_scale, want.view(torch.uint8))
    # Expert e's w1 and w3 are rows [0, I) and [I, 2I) of w13 (vLLM's gate/up order).
    inter = CONFIG["moe_intermediate_size"]
    w13 = params[stage + "ffn.experts.routed_experts.w13_weight_scale"][5]
    assert w13.dtype == torch.uint8
    assert torch.equal(w13[:inter], ckpt["mtp.1.ffn.experts.5.w1.scale"].view(torch.uint8))
    assert torch.equal(w13[inter:], ckpt["mtp.1.ffn.experts.5.w3.scale"].view(torch.uint8))
    w2 = params[stage + "ffn.experts.routed_experts.w2_weight"][7]
    assert torch.equal(w2, ckpt["mtp.1.ffn.experts.7.w2.weight"].view(torch.uint8))


@pytest.mark.parametrize(
    "name",
    ["mtp.0.attn.wo_a.scale", "mtp.1.ffn.shared_experts.w3.scale", "mtp.0.ffn.experts.9.w2.scale"],
)
def test_a_missing_scale_fails_by_name(quantised_draft, shipped_checkpoint, name):
    model, hf_config = quantised_draft
    partial = {k: v for k, v in shipped_checkpoint.items() if k != name}
    with pytest.raises(DSparkCheckpointError, match=rf"lacks 1 .*{name.replace('.', '[.]')}"):
        load_deepseek_v4_draft(model, partial, hf_config)


def stage_outputs(tmp_path, checkpoint: dict, config: dict) -> dict[str, torch.Tensor]:
    """Stage 0's quantised (or bf16) layers and ``main_proj`` of the loaded draft, after vLLM's
    ``process_weights_after_loading``, on one fixed input."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model_dir = tiny_v4.save_v4_target(tmp_path, checkpoint, config, keep_dtypes=True)
    vllm_config = v4_vllm_config(model_dir)
    draft_config = vllm_config.speculative_config.draft_model_config
    model = build_draft(vllm_config)
    load_deepseek_v4_draft(model, checkpoint, draft_config.hf_config)
    x = torch.randn(8, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    stage = model.backbone.layers[0]
    with set_current_vllm_config(vllm_config), set_forward_context(None, vllm_config):
        process_weights_after_loading(model, draft_config, torch.device("cpu"))
        return {
            "wq_b": stage.attn.wq_b(x),
            "main_proj": model.backbone.main_proj(torch.cat([x, x], dim=-1)),
            "shared_experts": stage.ffn.shared_experts(x),
            "moe": stage.ffn(x),
        }


def relative_errors(outputs: dict, reference: dict) -> dict[str, float]:
    return {
        name: (
            (outputs[name].float() - reference[name].float()).norm()
            / reference[name].float().norm()
        ).item()
        for name in reference
    }


def test_each_quantised_layer_computes_what_its_bf16_twin_computes(tmp_path, kernels):
    """The FP8 block linear (W8A16; vLLM's or the stand-in) gives the twin's bf16 result exactly;
    the MXFP4 MoE differs from the unquantised MoE by bf16 rounding only. With every stage-0
    scale one exponent off (a wrong e8m0 bias) the same comparison fails."""
    shipped, twin = quantise_v4.quantise_v4_checkpoint(tiny_v4.random_v4_checkpoint(CONFIG))
    reference = stage_outputs(tmp_path / "twin", twin, TWIN_CONFIG)
    errors = relative_errors(stage_outputs(tmp_path / "shipped", shipped, CONFIG), reference)
    print(f"relative errors against the bf16 twin: {errors}")
    assert errors["wq_b"] == errors["main_proj"] == errors["shared_experts"] == 0.0
    assert errors["moe"] < 0.01
    off_bias = {
        name: (t.view(torch.uint8) + 1).view(t.dtype)
        if name.startswith("mtp.0.") and name.endswith(".scale")
        else t
        for name, t in shipped.items()
    }
    wrong = relative_errors(stage_outputs(tmp_path / "off", off_bias, CONFIG), reference)
    assert min(wrong.values()) > 0.1, wrong


# --- In the engine ----------------------------------------------------------------------------


def draft_agreement(logs: list, runs: list) -> tuple[int, int]:
    """(draft tokens equal in both logs, draft tokens compared), over the anchors whose context
    (prompt and output up to the block's first token) is the same in both runs."""
    from dspark_fixtures.engine import read_draft_log

    a, b = (read_draft_log(log) for log in logs)
    equal = total = 0
    for index, prompt in enumerate(PROMPTS):
        outputs = [run.token_ids[index] for run in runs]
        same = next(
            (i for i, (x, y) in enumerate(zip(*outputs, strict=True)) if x != y), len(outputs[0])
        )
        request = str(index)
        for anchor in a[request].keys() & b[request].keys():
            if anchor + 1 >= len(prompt) + same:
                continue
            x, y = a[request][anchor]["drafts"], b[request][anchor]["drafts"]
            equal += sum(s == t for s, t in zip(x, y, strict=True))
            total += len(x)
    return equal, total


@pytest.fixture(scope="module")
def quantised_models(tmp_path_factory):
    from dspark_fixtures import standins

    standins.install_standins()
    root = tmp_path_factory.mktemp("v4-quantised")
    models = {}
    for kind, checkpoint in {
        "random": tiny_v4.random_v4_checkpoint(CONFIG),
        "moe": quantise_v4.moe_oracle_checkpoint(),
    }.items():
        shipped, twin = quantise_v4.quantise_v4_checkpoint(checkpoint)
        models[kind] = (
            tiny_v4.save_v4_target(root / kind, shipped, CONFIG, keep_dtypes=True),
            tiny_v4.save_v4_target(root / f"{kind}-twin", twin, TWIN_CONFIG, keep_dtypes=True),
        )
    return models


PROMPTS = [tiny_v4.cycle_prompt(10 + tiny_v4.PERIOD * i, 150 + 20 * i) for i in range(3)]
MAX_TOKENS = [64, 72, 80]


def run_measuring_moe(model, log) -> tuple:
    """DSpark with the draft log, and per draft stage ``|MoE output| / |its layer input|`` (the
    mHC-mixed residual ``u`` of ``f = ffn(ffn_norm(u))``) over every row of the run."""
    from dspark_fixtures.engine import TinyEngine
    from tests.engine_v4.v4_harness import V4_ENGINE_ARGS

    spec = dspark(K, dspark_draft_log=str(log))
    with TinyEngine(model, spec, **V4_ENGINE_ARGS) as engine:
        stages = engine.model_runner.drafter.model.backbone.layers
        squares = [[0.0, 0.0] for _ in stages]
        for stage, sums in zip(stages, squares, strict=True):
            stage.ffn_norm.register_forward_pre_hook(
                lambda _, args, sums=sums: sums.__setitem__(0, sums[0] + norm2(args[0]))
            )
            stage.ffn.register_forward_hook(
                lambda _, args, out, sums=sums: sums.__setitem__(1, sums[1] + norm2(out))
            )
        run = engine.generate_stepwise(PROMPTS, MAX_TOKENS)
    return run, [(f / u) ** 0.5 for u, f in squares]


def norm2(x: torch.Tensor) -> float:
    return x.float().pow(2).sum().item()


@pytest.fixture(scope="module")
def moe_runs(quantised_models, kernels, tmp_path_factory):
    """The contributing-MoE draft, quantised and its twin, with draft logs and MoE ratios."""
    root = tmp_path_factory.mktemp(f"moe-{kernels}")
    logs = [root / "quantised.jsonl", root / "twin.jsonl"]
    measured = [
        run_measuring_moe(m, log) for m, log in zip(quantised_models["moe"], logs, strict=True)
    ]
    return logs, [run for run, _ in measured], [ratios for _, ratios in measured]


def test_quantised_draft_is_lossless(quantised_models, moe_runs):
    """The context-dependent oracle target, quantised, its draft's MoE contributing: drafts both
    accepted and rejected, and greedy output equal to plain decoding. (A random target is no test
    of this here: its near ties flip with batch composition in plain decoding alone.)"""
    quantised, _ = quantised_models["moe"]
    plain = run_v4(quantised, PROMPTS, MAX_TOKENS)
    run = moe_runs[1][0]
    assert run.token_ids == plain.token_ids
    accepted = run.metrics["vllm:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < run.metrics["vllm:spec_decode_num_draft_tokens"]


def test_the_drafts_moe_contributes(moe_runs):
    """Each draft stage's MoE output is a sizeable fraction of the residual it is added to (the
    oracle checkpoint's draft MoE, with zero ``w2``, gives 0)."""
    ratios = moe_runs[2][0]
    print(f"draft MoE output / layer input, per stage: {ratios}")
    assert min(ratios) > 0.1


def test_quantised_draft_drafts_as_its_bf16_twin(moe_runs):
    """The oracle draft with a contributing MoE against its twin: the same drafts at >= 99% of
    the draft tokens (with every draft expert scale one exponent off, 75/292 on the stand-ins
    and 74/292 on AMX: the MoE decides drafts)."""
    logs, runs, _ = moe_runs
    equal, total = draft_agreement(logs, runs)
    print(f"moe: drafts equal to the bf16 twin's at {equal}/{total} ({equal / total:.2%})")
    assert total >= 200
    assert equal >= 0.99 * total


def test_random_quantised_draft_mostly_drafts_as_its_bf16_twin(quantised_models, kernels, tmp_path):
    """A random draft: every draft token is an argmax among near ties, and its MoE sees the
    bf16-level difference between the MXFP4 and unquantised MoE: a lower floor."""
    logs = [tmp_path / "quantised.jsonl", tmp_path / "twin.jsonl"]
    runs = [
        run_v4(model, PROMPTS, MAX_TOKENS, dspark(K, dspark_draft_log=str(log)))
        for model, log in zip(quantised_models["random"], logs, strict=True)
    ]
    equal, total = draft_agreement(logs, runs)
    print(f"random: drafts equal to the bf16 twin's at {equal}/{total} ({equal / total:.2%})")
    assert total >= 200
    assert equal >= 0.85 * total


def test_the_targets_own_quantization_is_not_refused_and_another_is():
    """vLLM copies the target's quantization into the draft's speculative config; the V4 draft
    is built with it. Any other value is refused by name."""
    from vllm.v1.spec_decode.dspark.checks import (
        DEEPSEEK_V4_UNSUPPORTED,
        refuse_unsupported_fields,
    )

    target = types.SimpleNamespace(quantization="deepseek_v4_fp8")
    inherited = types.SimpleNamespace(quantization="deepseek_v4_fp8", target_model_config=target)
    refuse_unsupported_fields(inherited, DEEPSEEK_V4_UNSUPPORTED)
    other = types.SimpleNamespace(quantization="fp8", target_model_config=target)
    with pytest.raises(ValueError, match=r"speculative_config\.quantization='fp8'"):
        refuse_unsupported_fields(other, DEEPSEEK_V4_UNSUPPORTED)
