# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""What a CUDA host runs of the DeepSeek-V4 draft that the CPU engine does not, checked on CPU.

- Signatures: the draft's calls into vLLM's platform-specific code (each platform's
  ``DeepseekV4MoE``, the mHC custom ops, the rotary) bind against the signatures written in
  vLLM 0.32.0's and 0.33.0's sources, parsed with ``ast`` (CUDA-only modules are never
  imported).
- Kernel inputs and warm-up: every quantised linear of the draft step gets contiguous rows, and
  every TileLang mHC variant the draft step calls is queued for the runner's JIT warm-up.
- Host buffers: under async scheduling the next step's host code runs before a queued H2D copy
  has executed. A stand-in that lets each copy read its host source one step late (CPU copies are
  synchronous) reads the slots the step meant only if no host source is reused.
"""

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import vllm
from dspark_fixtures.checkpoints.deepseek_v4 import PERIOD, cycle_prompt
from dspark_fixtures.v4_draft import build_draft, v4_vllm_config
from tests.engine_v4.v4_harness import dspark, run_v4
from tests.helpers import VLLM_SOURCES

INSTALLED = Path(vllm.__file__).parent
VLLM_TREES = VLLM_SOURCES
PLATFORMS = ("nvidia", "amd", "xpu", "cpu")
MHC_OPS = ("MHCPreOp", "MHCPostOp", "HCHeadOp")
MHC_FORWARDS = ("forward_cuda", "forward_hip", "forward_xpu", "forward_cpu")


def trees() -> list[str]:
    return [name for name, root in VLLM_TREES.items() if root.is_dir()]


def parsed_signature(source: Path, class_name: str | None, name: str) -> inspect.Signature:
    """``class_name.name``'s signature as written in ``source``, without ``self``; with
    ``class_name`` None, the module-level function ``name``'s."""
    body = ast.parse(source.read_text()).body
    if class_name is not None:
        (cls,) = [n for n in body if isinstance(n, ast.ClassDef) and n.name == class_name]
        body = cls.body
    (func,) = [n for n in body if isinstance(n, ast.FunctionDef) and n.name == name]
    args, kind = func.args, inspect.Parameter
    positional = [*args.posonlyargs, *args.args][0 if class_name is None else 1 :]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    parameters = [
        kind(a.arg, kind.POSITIONAL_OR_KEYWORD, default=written_default(d))
        for a, d in zip(positional, defaults, strict=True)
    ]
    if args.vararg:
        parameters.append(kind(args.vararg.arg, kind.VAR_POSITIONAL))
    parameters += [
        kind(a.arg, kind.KEYWORD_ONLY, default=written_default(d))
        for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    if args.kwarg:
        parameters.append(kind(args.kwarg.arg, kind.VAR_KEYWORD))
    return inspect.Signature(parameters)


def written_default(node: ast.expr | None) -> object:
    """A parameter's default as written: the literal, ``...`` for an expression, or none."""
    if node is None:
        return inspect.Parameter.empty
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ...


# --- Construction: each platform's DeepseekV4MoE -----------------------------------------------


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("tree", trees())
def test_draft_builds_each_platforms_moe_with_the_arguments_it_takes(
    tiny_v4_models, monkeypatch, tree, platform
):
    """The draft's MoE construction binds against ``DeepseekV4MoE.__init__`` of
    ``models/deepseek_v4/<platform>/model.py``: NVIDIA's needs a keyword-only ``num_hash_layers``
    (a call with ``(vllm_config, prefix)`` only raises on every CUDA host)."""
    from vllm.v1.spec_decode.dspark.deepseek_v4 import layers

    source = VLLM_TREES[tree] / "models" / "deepseek_v4" / platform / "model.py"
    signature = parsed_signature(source, "DeepseekV4MoE", "__init__")
    bound: list[inspect.BoundArguments] = []

    class PlatformMoE(nn.Module):
        __signature__ = signature

        def __init__(self, *args, **kwargs) -> None:
            super().__init__()
            bound.append(signature.bind(*args, **kwargs))

    monkeypatch.setattr(layers, "platform_moe_class", lambda: PlatformMoE)
    config = v4_vllm_config(tiny_v4_models.oracle)
    draft = build_draft(config, device="cpu")

    num_stages = len(draft.backbone.layers)
    assert len(bound) == num_stages
    for arguments in bound:
        assert arguments.arguments["vllm_config"] is config
        assert arguments.arguments["prefix"].startswith("dspark.layers.")
        if "num_hash_layers" in signature.parameters:
            # The draft's virtual layer ids lie past the hash layers: noaux_tc routing.
            layer = int(arguments.arguments["prefix"].split(".")[2])
            assert arguments.arguments["num_hash_layers"] <= layer
        if "use_sequence_parallel" in arguments.arguments:
            assert arguments.arguments["use_sequence_parallel"] is False


# Constructors the draft's layers call, by the module that defines them.
CONSTRUCTORS = {
    "ReplicatedLinear": "model_executor/layers/linear.py",
    "ColumnParallelLinear": "model_executor/layers/linear.py",
    "MergedColumnParallelLinear": "model_executor/layers/linear.py",
    "RowParallelLinear": "model_executor/layers/linear.py",
    "RMSNorm": "model_executor/layers/layernorm.py",
}


@pytest.mark.parametrize("tree", trees())
def test_draft_layer_construction_binds_each_vllm_tree(tiny_v4_models, monkeypatch, tree):
    """The quantised linears, norms and the rotary the draft builds are called as their
    constructors are written in each vLLM tree (0.33.0's is never imported here)."""
    from vllm.v1.spec_decode.dspark.deepseek_v4 import backbone, layers

    calls: list[tuple[str, tuple, dict]] = []

    def recording(name):
        original = getattr(layers, name)

        def construct(*args, **kwargs):
            calls.append((name, args, kwargs))
            return original(*args, **kwargs)

        return construct

    for name in [*CONSTRUCTORS, "build_deepseek_v4_rope"]:
        monkeypatch.setattr(layers, name, recording(name))
    for name in ("ReplicatedLinear", "RMSNorm"):  # main_proj and the heads' norms
        monkeypatch.setattr(backbone, name, recording(name))
    build_draft(v4_vllm_config(tiny_v4_models.oracle), device="cpu")

    assert {name for name, _, _ in calls} == {*CONSTRUCTORS, "build_deepseek_v4_rope"}
    rope = VLLM_TREES[tree] / "models" / "deepseek_v4" / "common" / "rope.py"
    for name, args, kwargs in calls:
        if name == "build_deepseek_v4_rope":
            signature = parsed_signature(rope, None, name)
        else:
            signature = parsed_signature(VLLM_TREES[tree] / CONSTRUCTORS[name], name, "__init__")
        signature.bind(*args, **kwargs)


# --- Upstream's DeepSeek-V4 DSpark draft: the pieces this draft reuses -------------------------

UPSTREAM_DSPARK = Path("models") / "deepseek_v4" / "nvidia" / "dspark.py"
# (class, method) of upstream's draft the V4 draft calls on itself, with the arguments it passes
# and which of its objects is ``self``: the draft (``DSparkRingDraft``) or its backbone.
BORROWED = {
    ("DSparkDeepseekV4ForCausalLM", "_remap_dspark_name"): (("mtp.0.attn.wkv.weight",), "draft"),
    ("DSparkDeepseekV4ForCausalLM", "markov_embed"): (("token_ids",), "draft"),
    ("DSparkDeepseekV4ForCausalLM", "markov_bias"): (("markov_embed",), "draft"),
    ("DSparkDeepseekV4ForCausalLM", "compute_confidence"): (("hidden", "markov_embed"), "draft"),
    ("DSparkDeepseekV4Model", "combine_hidden_states"): (("target_features",), "backbone"),
}


def self_attribute_chains(source: Path, class_name: str, name: str) -> set[tuple[str, ...]]:
    """Every ``self.a.b...`` the method reads, as written in ``source`` (``("a", "b")``)."""
    (cls,) = [
        n
        for n in ast.parse(source.read_text()).body
        if isinstance(n, ast.ClassDef) and n.name == class_name
    ]
    (func,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name]
    chains = set()
    for node in ast.walk(func):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if parts and isinstance(node, ast.Name) and node.id == "self":
            chains.add(tuple(reversed(parts)))
    return chains


@pytest.mark.parametrize("tree", trees())
def test_upstream_dspark_methods_the_draft_reuses_apply_to_it(tiny_v4_models, tree):
    """Upstream's remap and head hooks, reused as functions on a draft laid out with upstream's
    names, take the arguments the draft passes and read only attributes the draft has, as each
    vLLM tree writes them (upstream's class itself builds NVIDIA paged-attention layers)."""
    draft = build_draft(v4_vllm_config(tiny_v4_models.oracle), device="meta")
    source = VLLM_TREES[tree] / UPSTREAM_DSPARK
    for (class_name, name), (args, owner) in BORROWED.items():
        parsed_signature(source, class_name, name).bind(*args)
        obj = draft if owner == "draft" else draft.backbone
        for chain in self_attribute_chains(source, class_name, name):
            value = obj
            for depth, attribute in enumerate(chain):
                assert value is not None and hasattr(value, attribute), (
                    f"{tree}: {class_name}.{name} reads self.{'.'.join(chain)}, which the "
                    f"draft's {owner} lacks at .{'.'.join(chain[: depth + 1])}"
                )
                value = getattr(value, attribute)
    # The expert-scale rule the loader imports is upstream's, with the same pattern.
    from vllm.models.deepseek_v4.nvidia.dspark import _EXPERT_SCALE_RE

    (pattern,) = [
        node.value.args[0].value
        for node in ast.parse(source.read_text()).body
        if isinstance(node, ast.Assign)
        and getattr(node.targets[0], "id", None) == "_EXPERT_SCALE_RE"
    ]
    assert pattern == _EXPERT_SCALE_RE.pattern


# --- The draft step's calls into platform code, recorded in the CPU engine ---------------------


class DraftStepCalls:
    """Records, during ``BlockDrafter.step`` only, each mHC custom-op call, each rotary call and
    each input a vLLM linear layer receives."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from vllm.model_executor.layers import mhc
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.v1.spec_decode.dspark.deepseek_v4.layers import RingAttention
        from vllm.v1.spec_decode.dspark.drafter import BlockDrafter

        self.ops: list[tuple[str, tuple, dict]] = []
        self.rope: list[tuple[type, tuple, dict]] = []
        self.linear_inputs: list[tuple[str, bool]] = []
        self._active = False
        for name in MHC_OPS:
            self._record_op(monkeypatch, getattr(mhc, name), name)
        step = BlockDrafter.step

        def recorded_step(drafter, *args, **kwargs):
            self._active = True
            try:
                return step(drafter, *args, **kwargs)
            finally:
                self._active = False

        monkeypatch.setattr(BlockDrafter, "step", recorded_step)
        rope = RingAttention.rope

        def recorded_rope(attention, x, positions, inverse=False):
            if self._active:
                forward = attention.rotary_emb.forward_native
                self.rope.append((type(attention.rotary_emb), (positions, x), {"inverse": inverse}))
                return forward(positions, x, inverse=inverse)[0]
            return rope(attention, x, positions, inverse)

        monkeypatch.setattr(RingAttention, "rope", recorded_rope)

        def record_linear(module, inputs):
            if self._active and isinstance(module, LinearBase):
                self.linear_inputs.append((module.prefix, inputs[0].is_contiguous()))

        self._hook = nn.modules.module.register_module_forward_pre_hook(record_linear)

    def _record_op(self, monkeypatch, op_class, name: str) -> None:
        forward = op_class.forward

        def recorded(op, *args, **kwargs):
            if self._active:
                self.ops.append((name, args, kwargs))
            return forward(op, *args, **kwargs)

        monkeypatch.setattr(op_class, "forward", recorded)

    def close(self) -> None:
        self._hook.remove()


@pytest.fixture(scope="module")
def draft_step_calls(tiny_v4_models):
    """One short oracle run of the V4 draft in the real CPU engine, calls recorded."""
    monkeypatch = pytest.MonkeyPatch()
    calls = DraftStepCalls(monkeypatch)
    try:
        prompts = [cycle_prompt(10, 40), cycle_prompt(10 + PERIOD, 45)]
        run = run_v4(tiny_v4_models.oracle, prompts, [8, 8], dspark(4), max_num_seqs=2)
    finally:
        calls.close()
        monkeypatch.undo()
    assert run.metrics["vllm:spec_decode_num_drafts"] > 0
    return calls


@pytest.mark.parametrize("tree", trees())
def test_draft_mhc_calls_bind_every_platform_forward(draft_step_calls, tree):
    """Each mHC op call of the draft step binds against that op's CUDA, ROCm, XPU and CPU
    forward as written in ``model_executor/layers/mhc.py``."""
    source = VLLM_TREES[tree] / "model_executor" / "layers" / "mhc.py"
    called = {name for name, _, _ in draft_step_calls.ops}
    assert called == set(MHC_OPS)
    for name, args, kwargs in draft_step_calls.ops:
        for forward in MHC_FORWARDS:
            parsed_signature(source, name, forward).bind(*args, **kwargs)


@pytest.mark.parametrize("tree", trees())
def test_draft_rotary_calls_bind_the_rotary_forward(draft_step_calls, tree):
    """The draft calls the rotary's ``forward_native`` directly (the same code on every
    platform): the call binds against the class's source in each vLLM tree."""
    assert draft_step_calls.rope
    for rope_class, args, kwargs in draft_step_calls.rope:
        relative = Path(inspect.getsourcefile(rope_class)).relative_to(INSTALLED)
        owner = next(c for c in rope_class.__mro__ if "forward_native" in vars(c))
        source = VLLM_TREES[tree] / relative
        if owner is not rope_class:
            source = VLLM_TREES[tree] / Path(inspect.getsourcefile(owner)).relative_to(INSTALLED)
        parsed_signature(source, owner.__name__, "forward_native").bind(*args, **kwargs)


def test_every_linear_of_the_draft_step_gets_contiguous_rows(draft_step_calls):
    """Quantised linears take contiguous activations: the FP8 block-quantisation of a strided
    input leaves its CUDA kernel for Triton or fails on strides (``fp8_utils.py``)."""
    seen = {prefix for prefix, _ in draft_step_calls.linear_inputs}
    assert any(".wo_a." in prefix for prefix in seen), seen
    strided = {prefix for prefix, contiguous in draft_step_calls.linear_inputs if not contiguous}
    assert sorted(strided) == []


@pytest.mark.parametrize("tree", trees())
def test_every_mhc_variant_the_draft_calls_is_queued_for_warm_up(
    tiny_v4_models, draft_step_calls, tree
):
    """On CUDA mHC is TileLang, compiled per variant; the runner compiles what was registered
    before serving. The draft's registrations bind against each kernel's ``get_warmup_keys`` in
    ``kernels/mhc/tilelang_kernels.py`` and name the variant of every recorded call: the pre
    kernel with or without a fused norm weight and the same eps values, the post kernel and the
    head for the same widths."""
    from vllm.v1.spec_decode.dspark.deepseek_v4.layers import mhc_warmup_registrations

    source = VLLM_TREES[tree] / "model_executor" / "kernels" / "mhc" / "tilelang_kernels.py"
    kernel_classes = {
        node.targets[0].id: node.value.func.id
        for node in ast.parse(source.read_text()).body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id.endswith("_TILELANG_KERNEL")
    }
    config = v4_vllm_config(tiny_v4_models.oracle)
    hf_config = config.model_config.hf_config
    for include_pre_gemm_splits in (True, False):
        registrations = mhc_warmup_registrations(config, hf_config, include_pre_gemm_splits)
        by_kernel = {}
        for name, args, kwargs in registrations:
            signature = parsed_signature(source, kernel_classes[name], "get_warmup_keys")
            by_kernel[name] = signature.bind(*args, **kwargs).arguments

        for op, args, kwargs in draft_step_calls.ops:
            cuda = parsed_signature(
                VLLM_TREES[tree] / "model_executor" / "layers" / "mhc.py", op, "forward_cuda"
            ).bind(*args, **kwargs)
            cuda.apply_defaults()
            call = cuda.arguments
            if op == "MHCPreOp":
                warm = by_kernel["_MHC_PRE_BIG_FUSE_TILELANG_KERNEL"]
                assert warm["use_norm_weight"] == (call["norm_weight"] is not None)
                for field in (
                    "rms_eps",
                    "hc_pre_eps",
                    "hc_sinkhorn_eps",
                    "hc_post_mult_value",
                    "sinkhorn_repeat",
                ):
                    assert warm[field] == call[field], field
                assert tuple(call["residual"].shape[-2:]) == (warm["hc_mult"], warm["hidden_size"])
            elif op == "MHCPostOp":
                warm = by_kernel["_MHC_POST_TILELANG_KERNEL"]
                assert tuple(call["residual"].shape[-2:]) == (warm["hc_mult"], warm["hidden_size"])
            else:
                warm = by_kernel["_HC_HEAD_FUSED_TILELANG_KERNEL"]
                assert (warm["rms_eps"], warm["hc_eps"]) == (
                    call["rms_norm_eps"],
                    call["hc_eps"],
                )
                assert tuple(call["hidden_states"].shape[-2:]) == (
                    warm["hc_mult"],
                    warm["hidden_size"],
                )


# --- Host buffers under a queued copy ---------------------------------------------------------


class LateCopies(TorchFunctionMode):
    """Non-blocking host-to-device copies issued by ``propose`` read their host source only when
    the next ``propose`` has returned (a device one step behind the host); counts the copies whose
    source by then no longer holds what it held when the copy was issued."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.checked = 0
        self.wrong = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("non_blocking"):
            source = args[1] if func is torch.Tensor.copy_ else args[0]
            if func in (torch.Tensor.copy_, torch.Tensor.to) and source.device.type == "cpu":
                self.pending.append((source, source.clone()))
        return func(*args, **kwargs)

    def step_done(self, issued: int) -> None:
        """Run the copies issued before the step that just ended."""
        for source, meant in self.pending[:issued]:
            self.checked += 1
            self.wrong += int(not torch.equal(source, meant))
        del self.pending[:issued]


def cuda_async_tensor_h2d():
    """vLLM's ``async_tensor_h2d`` as a CUDA host runs it (a non-blocking copy from a host
    tensor), read from the installed source: vLLM's CPU worker replaces the module's function
    with a synchronous one when it is imported."""
    spec = importlib.util.spec_from_file_location(
        "torch_utils_as_on_cuda", INSTALLED / "utils" / "torch_utils.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.async_tensor_h2d


def late_copy_run(target: Path, monkeypatch: pytest.MonkeyPatch, upload=None) -> LateCopies:
    """The run with the proposer's slot upload done by ``upload`` (default: vLLM's own)."""
    from vllm.v1.spec_decode.dspark import ring_proposer
    from vllm.v1.spec_decode.dspark.ring_proposer import DSparkRingProposer

    monkeypatch.setattr(ring_proposer, "async_tensor_h2d", upload or cuda_async_tensor_h2d())
    copies = LateCopies()
    propose = DSparkRingProposer.propose

    def propose_with_late_copies(proposer, *args, **kwargs):
        earlier = len(copies.pending)
        with copies:
            drafts = propose(proposer, *args, **kwargs)
        copies.step_done(earlier)
        return drafts

    monkeypatch.setattr(DSparkRingProposer, "propose", propose_with_late_copies)
    # Five requests through two slots: requests finish at different steps, new ones take their
    # rows and slots, so the slot list changes between steps.
    prompts = [cycle_prompt(10 + PERIOD * i, 40 + 5 * i) for i in range(5)]
    run_v4(target, prompts, [6, 14, 9, 12, 7], dspark(4), max_num_seqs=2)
    return copies


def test_slot_uploads_read_the_slots_their_step_meant_when_the_copy_runs_late(
    tiny_v4_models, monkeypatch
):
    """Each step's slot ids go up from a fresh pinned tensor (vLLM's ``async_tensor_h2d``): a
    copy that runs after the next step's host code still reads its own step's slots."""
    copies = late_copy_run(tiny_v4_models.oracle, monkeypatch)
    assert copies.checked >= 10
    assert copies.wrong == 0


def test_late_copies_catch_a_reused_host_buffer(tiny_v4_models, monkeypatch):
    """Control: with one reused host buffer (``CpuGpuBuffer.copy_to_gpu``, as the proposer had
    it), late copies read another step's slots whenever the batch changed."""
    from vllm.v1.utils import CpuGpuBuffer

    reused = CpuGpuBuffer(64, dtype=torch.int64, device=torch.device("cpu"), with_numpy=True)

    def upload_through_reused_buffer(slots, device, dtype):
        reused.np[: len(slots)] = slots
        return reused.copy_to_gpu(len(slots))

    copies = late_copy_run(tiny_v4_models.oracle, monkeypatch, upload_through_reused_buffer)
    assert copies.checked >= 10
    assert copies.wrong >= 1


# --- Memory: what vLLM's profile run sees -----------------------------------------------------


def test_profile_run_writes_the_context_and_fills_the_one_probs_buffer(tiny_v4_models, monkeypatch):
    """The proposer's dummy_run (vLLM's memory profile calls it with max_num_batched_tokens)
    projects and writes that many target rows into the ring and writes every request's
    distributions into the single preallocated ``[max_num_seqs, k, V]`` buffer of probabilistic
    drafts; EAGLE's per-token buffers, which the ring draft never reads, hold nothing."""
    from dspark_fixtures.engine import TinyEngine
    from tests.engine_v4.v4_harness import V4_ENGINE_ARGS
    from vllm.v1.spec_decode.dspark import ring_proposer
    from vllm.v1.spec_decode.dspark.drafter import BlockDrafter

    written_rows: list[int] = []
    write_context = BlockDrafter.write_context

    def recorded_write(drafter, request_slots, target_features, *args):
        written_rows.append(target_features.shape[0])
        return write_context(drafter, request_slots, target_features, *args)

    monkeypatch.setattr(BlockDrafter, "write_context", recorded_write)
    spec = dspark(4, draft_sample_method="probabilistic")
    with TinyEngine(tiny_v4_models.oracle, spec, **{**V4_ENGINE_ARGS, "max_num_seqs": 3}) as engine:
        runner = engine.model_runner
        proposer = runner.drafter
        probs = proposer._drafter.draft_probs
        vocab = runner.vllm_config.model_config.get_vocab_size()
        assert probs.shape == (3, 4, vocab) and probs.dtype == torch.float32
        for name in ring_proposer._UNUSED_BASE_BUFFERS:
            assert getattr(proposer, name).numel() == 0, name

        probs.zero_()
        written_rows.clear()
        max_tokens = runner.vllm_config.scheduler_config.max_num_batched_tokens
        proposer.dummy_run(max_tokens)
        assert written_rows == [max_tokens]
        torch.testing.assert_close(probs.sum(-1), torch.ones(3, 4))
