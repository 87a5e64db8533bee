# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Serving profiles (`recipe/profiles/*.yaml`): what to serve and how, identical on every rank.

Values that must agree across ranks (model, revision, parallelism, speculative config) live only
here, so one rendering feeds both nodes; per-cluster values live in the site file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from dspark_common.operator_input import describe, escaped, shown
from dspark_launch.errors import ConfigError
from dspark_launch.lanes import LANES, RUNNER_ENV, V1, V2, adaptive_verification_problem
from dspark_launch.schema import Section, read_yaml

PROFILES_DIR = Path(__file__).resolve().parents[2] / "recipe" / "profiles"
SPECULATIVE_METHODS = ("dspark", "none")
DRAFT_SAMPLE_METHODS = ("probabilistic", "greedy")
START_ORDERS = ("worker-first", "head-first")

# Flags the launcher renders itself from profile or site keys; a duplicate in `serve_args`
# would silently override them (argparse keeps the last one) or differ between ranks.
MANAGED_FLAGS = {
    "--revision": "revision",
    "--served-model-name": "served_model_name",
    "--tensor-parallel-size": "tensor_parallel_size",
    "--pipeline-parallel-size": "tensor_parallel_size",
    "--distributed-executor-backend": "(always mp)",
    "--nnodes": "(always 2)",
    "--node-rank": "(set per node)",
    "--master-addr": "site head.address",
    "--master-port": "site ports.master",
    "--headless": "(set on the worker)",
    "--host": "site api_bind",
    "--port": "site ports.api",
    "--api-key": "site secrets (passed as VLLM_API_KEY, never on the command line)",
    "--max-num-seqs": "max_num_seqs",
    "--max-model-len": "max_model_len",
    "--kv-cache-dtype": "kv_cache_dtype",
    "--dtype": "dtype",
    "--speculative-config": "speculative",
    # vLLM's default covers the widest decode batch, max_num_seqs * (k + 1) tokens; a smaller
    # maximum is cut to vLLM's capture grid (36 became 32, leaving 5-6 requests without graphs).
    "--max-cudagraph-capture-size": "(left to vLLM's default: it covers max_num_seqs * (k + 1))",
    "--enforce-eager": "cuda_graphs: false",
    "--config": "(a vLLM config file could set any of these flags; list flags in serve_args)",
}
# vLLM's other spellings of managed flags (its short options and negations).
FLAG_ALIASES = {
    "-tp": "--tensor-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-n": "--nnodes",
    "-r": "--node-rank",
    "-sc": "--speculative-config",
    "--no-enforce-eager": "--enforce-eager",
}
# vLLM's serve parser prints its help and exits on these (`--help=TOPIC` included): the rank
# would exit at once, successfully, without serving.
EXITING_FLAGS = {"--help": "--help", "-h": "--help"}
# Keys of `--compilation-config` the launcher owns -> the managed flag that sets them too.
COMPILATION_KEYS = {"max_cudagraph_capture_size": "--max-cudagraph-capture-size"}
COMPILATION_CONFIG = "--compilation-config"
# Env the launcher sets per node or from secrets; a profile must not pin them.
MANAGED_ENV = (
    "VLLM_HOST_IP",
    "VLLM_API_KEY",
    "HF_TOKEN",
    "HF_HOME",
    "NCCL_IB_HCA",
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_GID_INDEX",
    "GLOO_SOCKET_IFNAME",
    "TP_SOCKET_IFNAME",
    "DSPARK_HOST",
    "DSPARK_PORT",
    RUNNER_ENV,
)


@dataclass(frozen=True)
class Lane:
    """What a lane adds to the profile; every other value is the same in both lanes."""

    adaptive_verification: bool = False  # V2 only: vLLM trims each step's drafts on device


@dataclass(frozen=True)
class Speculative:
    method: str
    num_speculative_tokens: int
    draft_sample_method: str
    draft_model: str | None  # None: the target checkpoint carries the DSpark head (DSV4)

    def config_json(self, adaptive_verification: bool = False) -> str | None:
        """The `--speculative-config` value, serialized (never string-built: no injection)."""
        if self.method == "none":
            return None
        config: dict[str, str | int | bool] = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "draft_sample_method": self.draft_sample_method,
        }
        if self.draft_model:
            config["model"] = self.draft_model
        if adaptive_verification:
            config["enable_adaptive_verification"] = True
        return json.dumps(config, separators=(",", ":"))


@dataclass(frozen=True)
class Profile:
    name: str
    model: str
    revision: str | None
    served_model_name: str
    nodes: int  # 2: the launcher's two-node deployment; 1: one host, served with `docker run`
    tensor_parallel_size: int
    max_num_seqs: int
    max_model_len: int
    kv_cache_dtype: str
    dtype: str | None
    cuda_graphs: bool
    speculative: Speculative
    nccl_roce: bool
    start_order: str
    serve_args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    lanes: dict[str, Lane] = field(default_factory=lambda: {V1: Lane()})
    compute_capability: tuple[str, ...] = ()

    def serve_arg(self, flag: str) -> str | None:
        """The value `serve_args` gives `flag` (`--flag=value` or `--flag value`), else None."""
        for index, arg in enumerate(self.serve_args):
            if arg.startswith(f"{flag}="):
                return arg.split("=", 1)[1]
            if arg == flag and index + 1 < len(self.serve_args):
                return self.serve_args[index + 1]
        return None

    @property
    def uses_hub_snapshot(self) -> bool:
        return not self.model.startswith("/")


def managed_flag(arg: str) -> str | None:
    """The managed flag that `arg` sets when vLLM parses it, else None."""
    return _parsed_as(arg, {**{flag: flag for flag in MANAGED_FLAGS}, **FLAG_ALIASES})


def exiting_flag(arg: str) -> str | None:
    """The flag that makes vLLM's parser print and exit when `arg` is parsed, else None."""
    return _parsed_as(arg, EXITING_FLAGS)


def _parsed_as(arg: str, options: dict[str, str]) -> str | None:
    """The flag of `options` (a spelling -> its flag) that vLLM's parser reads `arg` as.

    vLLM's parser turns `_` into `-` in `--names`, reads `--flag.key` as a key of `--flag`'s
    JSON, and is an argparse parser with allow_abbrev: an option may be shortened to any
    prefix (a prefix shared by several options is an error there, refused here too), takes
    `=value`, and a two-character short option takes its value attached (`-n2`)."""
    if not arg.startswith("-") or arg in ("-", "--"):
        return None
    name = arg.split("=", 1)[0].split(".", 1)[0]
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-")
    for option, flag in options.items():
        prefix = name.startswith("--") == option.startswith("--") and option.startswith(name)
        attached = not name.startswith("--") and len(option) == 2 and name[:2] == option
        if prefix or attached:
            return flag
    return None


def _json_keys(value: str | None) -> set[str]:
    try:
        parsed = json.loads(value or "")
    except ValueError:
        return set()
    return set(parsed) if isinstance(parsed, dict) else set()


def managed_compilation_key(arg: str, following: str | None) -> tuple[str, str] | None:
    """(key, managed flag) when `arg` (its value attached or `following`) sets a
    `--compilation-config` key the launcher owns, else None.

    vLLM's parser reads `--compilation-config` (any prefix, underscores for dashes) and `-cc`
    with JSON as `=value` or the next argument, and `--compilation-config.key`/`-cc.key` (a
    `+` suffix appends) with the key's value."""
    name, has_value, attached = arg.partition("=")
    option, dotted, key = name.partition(".")
    if option.startswith("--"):
        option = "--" + option[2:].replace("_", "-")
        if len(option) < 4 or not COMPILATION_CONFIG.startswith(option):
            return None
    elif option != "-cc":
        return None
    if dotted:
        keys = {key.split(".", 1)[0].removesuffix("+")}
    else:
        keys = _json_keys(attached if has_value else following)
    for key in sorted(keys):
        flag = COMPILATION_KEYS.get(key.replace("-", "_"))
        if flag is not None:
            return key, flag
    return None


def resolve_profile_path(name_or_path: str, relative_to: Path) -> Path:
    """A bare name means `recipe/profiles/<name>.yaml`; anything with a slash is a path."""
    if "/" in name_or_path or name_or_path.endswith(".yaml"):
        path = Path(name_or_path)
        return path if path.is_absolute() else relative_to / path
    return PROFILES_DIR / f"{name_or_path}.yaml"


def load_profile(path: Path) -> Profile:
    kind = describe(path)
    if kind != "is a regular file":  # read_yaml refuses it too, without the hint
        hint = " (see recipe/profiles/ for the shipped ones)" if kind == "does not exist" else ""
        raise ConfigError(f"profile {escaped(str(path))} {kind}{hint}")
    top = Section(read_yaml(path), path)
    top.string("description", required=False, argv=False)
    model = top.string("model")
    assert model is not None
    is_path = model.startswith("/")
    revision = top.matching("revision", r"[0-9a-f]{40}", "a 40-hex commit id", required=not is_path)
    if is_path and revision is not None:
        raise top.error("revision", "must be omitted when model is a local directory")
    spec = top.section("speculative")
    method = spec.choice("method", SPECULATIVE_METHODS)
    speculative = Speculative(
        method=method,
        num_speculative_tokens=spec.integer("num_speculative_tokens", 1, 16, default=1),
        draft_sample_method=spec.choice(
            "draft_sample_method", DRAFT_SAMPLE_METHODS, default="probabilistic"
        ),
        draft_model=spec.string("draft_model", required=False),
    )
    if method == "dspark" and not spec.has("num_speculative_tokens"):
        raise spec.error("num_speculative_tokens", "required when method is dspark")
    spec.finish()
    serve_args = top.string_list("serve_args")
    for index, arg in enumerate(serve_args):
        flag = managed_flag(arg)
        if flag:
            raise top.error(
                "serve_args",
                # The option only: a value after `=` may be a secret (`--api-key=...`).
                f"{shown(arg.split('=', 1)[0])} sets {flag}, which the launcher sets from "
                f"{MANAGED_FLAGS[flag]}",
            )
        if exiting_flag(arg):
            raise top.error(
                "serve_args",
                f"{shown(arg)} makes vLLM's parser print its help and exit instead of serving; "
                "remove it",
            )
        owned = managed_compilation_key(arg, next(iter(serve_args[index + 1 :]), None))
        if owned:
            key, flag = owned
            raise top.error(
                "serve_args",
                f"{shown(arg.split('=', 1)[0].split('.', 1)[0])} sets {key}, which the "
                f"launcher sets from {MANAGED_FLAGS[flag]}",
            )
    env = top.string_map("env")
    for name in env:
        if name == RUNNER_ENV:
            raise top.error(f"env.{name}", "is set by the launcher from the site file's lane")
        if name in MANAGED_ENV:
            raise top.error(f"env.{name}", "is set by the launcher per node or from site secrets")
    compute_capability = tuple(top.string_list("compute_capability"))
    for capability in compute_capability:
        if not re.fullmatch(r"\d{1,2}\.\d", capability):
            raise top.error("compute_capability", f'{shown(capability)} is not like "12.1"')
    cuda_graphs = top.boolean("cuda_graphs")
    lanes = _lanes(top, method, compute_capability, cuda_graphs)
    profile = Profile(
        name=path.stem,
        model=model,
        revision=revision,
        served_model_name=top.string("served_model_name", default=model) or model,
        nodes=top.integer("nodes", 1, 2, default=2),
        tensor_parallel_size=top.integer("tensor_parallel_size", 1, 64),
        max_num_seqs=top.integer("max_num_seqs", 1, 4096),
        max_model_len=top.integer("max_model_len", 16, 1 << 24),
        kv_cache_dtype=top.string("kv_cache_dtype", default="auto") or "auto",
        dtype=top.string("dtype", required=False),
        cuda_graphs=cuda_graphs,
        speculative=speculative,
        nccl_roce=top.boolean("nccl_roce"),
        start_order=top.choice("start_order", START_ORDERS, default="worker-first"),
        serve_args=tuple(serve_args),
        env=env,
        lanes=lanes,
        compute_capability=compute_capability,
    )
    if profile.nodes == 2 and profile.tensor_parallel_size % 2:
        raise top.error("tensor_parallel_size", "must be even: it is split over 2 nodes")
    top.finish()
    return profile


def _lanes(
    top: Section, method: str, compute_capability: tuple[str, ...], cuda_graphs: bool
) -> dict[str, Lane]:
    """`lanes:` lists the lanes the profile serves (default: the V1 lane only); `v2_lane:`
    holds what the V2 lane adds."""
    names = top.string_list("lanes") or [V1]
    for name in names:
        if name not in LANES:
            raise top.error("lanes", f"must list some of {', '.join(LANES)}; got {shown(name)}")
    if len(set(names)) != len(names):
        raise top.error("lanes", "lists a lane twice")
    settings = top.section("v2_lane", required=False)
    if settings.has("adaptive_verification") and V2 not in names:
        raise top.error("v2_lane", "is for the V2 lane, which lanes does not list")
    adaptive = settings.boolean("adaptive_verification", default=False)
    if adaptive:
        problem: str | None
        if method != "dspark":
            problem = "is DSpark's: it needs speculative.method: dspark"
        elif not cuda_graphs:
            problem = "needs cuda_graphs: true (vLLM verifies adaptively in full CUDA graphs)"
        else:
            problem = adaptive_verification_problem(compute_capability)
        if problem:
            raise settings.error("adaptive_verification", problem)
    settings.finish()
    return {name: Lane(adaptive and name == V2) for name in names}
