# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Dry start of a serving profile on a target device, without the device.

    python -m tools.dry_start --profile deepseek-v4-flash-2x-spark --device gb10 [--rank N]
        [--site FILE] [--json] [--verbose]

Runs vLLM's start-up (`engine.py`) for the ranks of the profile (both ranks of a two-node
profile; `--rank N` or `--json`: one, rank 0 by default), with the `vllm serve` arguments the
launcher renders for each rank (on the site file's addresses and ports with `--site`, else on
stand-in loopback ones), the checkpoint's config.json (`checkpoints.py`) and the device answered
from a table (`table.py`). It prints each rank's summary; vLLM's logs go to a file per rank
(`--verbose`: to stderr). Run it with `.venv`'s Python: it restarts itself on the tree of the
vLLM the images ship, 0.33.0's Python with CPU extensions (`environment.py`).
Exit status: 0 when vLLM accepted everything; 2 for bad arguments: the dry start's own, a rank
outside the deployment's world size, or the profile's values refused by vLLM's parser or config
rules (any exit of the parser included); 1 when vLLM refused while starting the engine. A refusal
is always the last line (and the `--json` report's `refusal`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / ".cache" / "wheels"
sys.path.insert(0, str(REPO / "launch"))

from dspark_common.operator_input import escaped  # noqa: E402
from dspark_launch.errors import ConfigError  # noqa: E402
from dspark_launch.lanes import LANES, V1, runner_env  # noqa: E402
from dspark_launch.profile import Profile, load_profile, resolve_profile_path  # noqa: E402
from dspark_launch.render import serve_args  # noqa: E402
from dspark_launch.site import HEAD, WORKER, Node, Secrets, Site, load_site  # noqa: E402
from tools.dry_start import checkpoints, engine, environment, kernels, summary, table  # noqa: E402
from tools.dry_start.engine import finish  # noqa: E402


def vllm_wheel() -> Path | None:
    """The vLLM wheel whose Python this interpreter imports (the setup script keeps it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        wanted = version("vllm")
    except PackageNotFoundError:
        return None
    return next(iter(sorted(WHEELS.glob(f"vllm-{wanted}-*.whl"))), None)


def stand_in_site(profile: Profile, hf_home: Path, lane: str) -> Site:
    """A docker-mode site on loopback addresses: what the launcher's rendering needs to put the
    profile's arguments together (the addresses and ports change nothing vLLM decides)."""

    def node(role: str, rank: int) -> Node:
        return Node(role, rank, f"127.0.0.{rank + 1}", None, None, None, None, hf_home, hf_home)

    return Site(
        path=Path("dry-start"),
        profile=profile.name,
        mode="docker",
        image=None,
        venv=None,
        api_bind="127.0.0.1",
        api_port=8000,
        master_port=29500,
        health_timeout_s=1,
        health_interval_s=1,
        head=node(HEAD, 0),
        worker=node(WORKER, 1),
        secrets=Secrets(None, None),
        nccl_passthrough={},
        lane=lane,
    )


def rank_args(
    profile: Profile, rank: int, hf_home: Path, lane: str = V1, site: Site | None = None
) -> list[str]:
    """The `vllm serve` arguments the launcher renders for the node that holds `rank` (on
    `site`'s addresses and ports, else on stand-in ones)."""
    site = site or stand_in_site(profile, hf_home, lane)
    node = site.head if rank == 0 else site.worker
    return list(serve_args(profile, site, node))


def restart_in_dry_start_tree(argv: list[str]) -> str | None:
    """Run again with the dry start's vLLM tree first on the path, unless this Python already
    imports vLLM from it. Returns why that failed; on success it does not return."""
    spec = importlib.util.find_spec("vllm")
    tree = environment.tree_path()
    if spec is not None and spec.origin is not None and Path(spec.origin).parents[1] == tree:
        return None
    try:
        tree = environment.ensure()
    except (FileNotFoundError, RuntimeError) as error:
        return str(error)
    path = os.pathsep.join(filter(None, (str(tree), str(REPO), os.environ.get("PYTHONPATH"))))
    os.environ["PYTHONPATH"] = path
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "tools.dry_start", *argv])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.dry_start", description=__doc__.split("\n", 1)[0]
    )
    parser.add_argument("--profile", required=True, help="a name in recipe/profiles/ or a path")
    parser.add_argument("--device", required=True, choices=sorted(table.DEVICES))
    parser.add_argument(
        "--rank", type=int, help="the one rank to play (default: every rank; 0 with --json)"
    )
    parser.add_argument(
        "--site", type=Path, help="a site file: its addresses and ports in the serve arguments"
    )
    parser.add_argument("--verbose", action="store_true", help="vLLM's logs on stderr")
    parser.add_argument(
        "--lane", choices=LANES, default=V1, help="the model runner (docs/lanes.md)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    options = parser.parse_args(argv)
    try:
        profile = load_profile(resolve_profile_path(options.profile, Path.cwd()))
        site = load_site(options.site) if options.site else None
    except ConfigError as error:
        print(f"dry start: {error}", file=sys.stderr)
        return 2
    if options.lane not in profile.lanes:
        print(
            f"dry start: profile {escaped(profile.name)} does not serve the {options.lane} lane",
            file=sys.stderr,
        )
        return 2
    problem = restart_in_dry_start_tree(argv)
    if problem is not None:
        print(f"dry start: {problem}", file=sys.stderr)
        return 2
    device = table.DEVICES[options.device]
    wheel = vllm_wheel()
    if wheel is None:
        print(
            f"dry start: no vLLM wheel in {WHEELS}: a dry start on a table device reads vLLM's "
            "CUDA operators from it; run scripts/setup-cpu-env.sh",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="dspark-dry-start-") as scratch:
        hf_home = Path(scratch) / "hf"
        models = {profile.model: profile.revision}
        if profile.speculative.draft_model:
            models[profile.speculative.draft_model] = None
        try:
            checkpoints.write_offline_cache(hf_home, models)
        except KeyError as error:
            print(f"dry start: {escaped(error.args[0], 400)}", file=sys.stderr)
            return 2
        os.environ.update({**runner_env(options.lane), **profile.env})
        os.environ.update(
            HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", VLLM_CACHE_ROOT=f"{scratch}/vllm"
        )
        rank = options.rank or 0
        args = rank_args(profile, rank, hf_home, options.lane, site)
        logs = {
            r: None if options.verbose else summary.log_file(profile.name, options.device, r)
            for r in (rank, 1)
        }
        others = [] if options.rank is not None or options.json or profile.nodes == 1 else [1]
        children = {r: summary.start_rank(argv, r, logs[r]) for r in others}
        if logs[rank] is not None:
            named = ", ".join(str(logs[r]) for r in (rank, *others))
            print(
                f"vLLM's logs: {named} (--verbose prints them here)",
                file=sys.stderr if options.json else sys.stdout,
            )
        if others:
            print(f"rank {rank}: {node_label(site, rank)}", flush=True)

        def start() -> engine.Report:
            platform = table.install(device, wheel)
            version = wheel.name.split("-")[1]
            free = engine.FreeMemoryCases(device.free_memory_cases(), table.answer_free)
            return engine.run(
                args,
                rank,
                free,
                lambda: kernels.image_wheel(device.capability, version, WHEELS),
                platform,
                table.device_queries(device),
            )

        with summary.logs_to(logs[rank]):
            status = engine.report_and_exit(start, options.json)
        for other, child in children.items():
            report = summary.rank_report(child, other, logs[other])
            print(f"rank {other}: {node_label(site, other)}")
            print("\n".join(report.lines()))
            status = max(status, 0 if report.ok else 1)
        return status


def node_label(site: Site | None, rank: int) -> str:
    """Which node plays `rank`, at which address."""
    if site is None:
        role = "head" if rank == 0 else "worker (--headless)"
        return f"{role}; stand-in addresses (--site FILE renders your site's)"
    node = site.head if rank == 0 else site.worker
    master = f"{site.head.address}:{site.master_port}"
    return f"{node.role} at {node.address}, master {master}" + (
        f", over ssh {node.ssh}" if node.ssh else ""
    )


if __name__ == "__main__":
    finish(main(sys.argv[1:]))
