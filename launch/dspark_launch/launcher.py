# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The launcher's commands: preflight, start, stop, status, logs.

Order of `start`: refuse if ranks already exist, check both nodes, ship each rank's env file,
start the ranks in the profile's order, watch both ranks and the API until healthy, and prove
the server works with a one-token completion.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

from dspark_launch import link_check, serving_flags
from dspark_launch.container_rank import ContainerRank
from dspark_launch.errors import AlreadyRunning, ExitCode, LaunchError
from dspark_launch.health import ApiClient
from dspark_launch.lanes import V1, runner_args, runner_env
from dspark_launch.local_rank import LocalRank
from dspark_launch.nodes import Rank
from dspark_launch.profile import Profile
from dspark_launch.render import plan_node, serve_args
from dspark_launch.runner import Runner
from dspark_launch.shell import Shell
from dspark_launch.site import HEAD, WORKER, Node, Site

LOG_LINES_ON_FAILURE = 40
SELFTEST_MODULE = "tools.gpu_selftest"
# Its engine checks start real engines on CUDA (each up to 600 s); not measured on a GPU.
SELFTEST_TIMEOUT_S = 1800
DRY_START_MODULE = "tools.dry_start.engine"
DRY_START_TIMEOUT_S = 900
# The two ranks' collective: seconds to meet and finish once both Pythons run.
LINK_TIMEOUT_S = 60


class Launcher:
    def __init__(self, site: Site, profile: Profile, runner: Runner) -> None:
        self.site = site
        self.profile = profile
        self.runner = runner
        self.ranks = {node.role: self._rank(node) for node in site.nodes}
        self.api = ApiClient(site.probe_host, site.api_port, site.secrets.api_key)

    def _rank(self, node: Node) -> Rank:
        shell = Shell(self.runner, node)
        if self.site.mode == "local":
            assert self.site.venv is not None
            return LocalRank(shell, self.site.venv)
        assert self.site.image is not None
        return ContainerRank(shell, self.site.image)

    def _step(self, text: str) -> None:
        self.runner.say(f"==> {text}")

    # preflight -------------------------------------------------------------------------------

    def preflight(self, selftest: bool = True) -> dict[str, str]:
        """Check both nodes; return each node's resolved NCCL_IB_GID_INDEX ('' without RoCE)."""
        self._check_images()
        self._check_install()
        self._step(f"model snapshot {self.profile.model}@{self.profile.revision or 'local'}")
        for rank in self.ranks.values():
            rank.shell.probe(
                "snapshot",
                [str(rank.node.hf_home), self.profile.model, self.profile.revision or "-"],
            )
        self._check_serving_flags()
        self._dry_start()
        if selftest:
            self._run_selftest()
        self._step("ports free on the head")
        head = self.ranks[HEAD].shell
        head.probe("ports", [self.site.api_bind, str(self.site.api_port)])
        head.probe("ports", [self.site.head.address, str(self.site.master_port)])
        gids = {role: "" for role in self.ranks}
        if self.profile.nccl_roce:
            self._step("NCCL_IB_GID_INDEX per node")
            gids = {role: rank.shell.gid_index() for role, rank in self.ranks.items()}
        if self.profile.nodes == 2:
            self._join_nodes(gids)
        return gids

    def _check_images(self) -> None:
        if self.site.mode != "docker":
            return
        self._step(f"image {self.site.image} on both nodes")
        ids = {role: rank.image_id() for role, rank in self.ranks.items()}
        if self.runner.dry_run:
            return
        assert self.site.image is not None
        if self.site.image.startswith("sha256:"):  # an image ID: both must hold exactly it
            for role, image_id in ids.items():
                if image_id != self.site.image:
                    raise LaunchError(
                        f"{self.ranks[role].label}: {self.site.image} resolves to image "
                        f"{image_id}; load the same image on both nodes (docs/docker.md)"
                    )
        if ids[HEAD] != ids[WORKER]:
            raise LaunchError(
                f"image IDs differ: head {ids[HEAD]}, worker {ids[WORKER]}; "
                f"pull {self.site.image} again on both nodes"
            )

    def _check_install(self) -> None:
        """Both ranks must run identically patched vLLM; DSpark on the V1 lane needs the patch
        installed (the V2 lane is upstream's DSpark, which needs no install)."""
        required = self.profile.speculative.method == "dspark" and self.site.lane == V1
        self._step("install.py --status on both nodes" + ("" if required else " (informational)"))
        fine = "fine for speculative: none" if self.site.lane == V1 else "the V2 lane needs none"
        statuses = {}
        for role, rank in self.ranks.items():
            result = rank.install_status()
            if self.runner.dry_run:
                continue
            try:
                status = json.loads(result.stdout)
            except json.JSONDecodeError:
                status = {"state": f"unreadable ({result.last_error_line})", "digest": None}
            statuses[role] = status
            if status.get("state") != "installed" or result.rc != 0:
                message = f"{rank.label}: the DSpark patch is {status.get('state')}" + (
                    f" ({status['error']})" if status.get("error") else ""
                )
                if required:
                    raise LaunchError(f"{message}; run install.py (see docs/installer.md)")
                self.runner.say(f"    note: {message}; {fine}")
        digests = {role: status.get("digest") for role, status in statuses.items()}
        if digests and digests[HEAD] != digests[WORKER]:
            raise LaunchError(
                f"install.py --status digests differ: head {digests[HEAD]}, worker "
                f"{digests[WORKER]}; both nodes must run the same image"
            )

    def _check_serving_flags(self) -> None:
        """The head's serve args against vLLM's rules for the pinned snapshot's config.json."""
        head = self.ranks[HEAD]
        if self.profile.uses_hub_snapshot:
            repo = "models--" + self.profile.model.replace("/", "--")
            snapshot = f"{head.runtime_hf_home}/hub/{repo}/snapshots/{self.profile.revision}"
        else:
            snapshot = self.profile.model
        self._step("serving flags against vLLM's rules for the checkpoint (head)")
        args = [f"{snapshot}/config.json", *serve_args(self.profile, self.site, head.node)]
        answer = head.shell.run_script(serving_flags.__file__, args, head.runtime_python)
        if not self.runner.dry_run and not answer.get("ok"):
            raise LaunchError(f"{head.label}: serving flags: {answer.get('detail')}")

    def _dry_start(self) -> None:
        """vLLM's own start-up of each rank in its image, on the node's device, as far as it goes
        without loading the weights (`python -m tools.dry_start.engine`); a refusal stops
        here."""
        if self.site.mode != "docker":  # local mode runs the venv's CPU vLLM
            return
        self._step("dry start of vLLM's start-up on both nodes (no weights loaded)")
        refused = []
        for role, rank in self.ranks.items():
            env = {**runner_env(self.site.lane), **self.profile.env}
            env["HF_HOME"] = rank.runtime_hf_home
            args = ["--rank", str(rank.node.rank), "--json"]
            args += [f"--env={name}={value}" for name, value in env.items()]
            args += ["--", *serve_args(self.profile, self.site, rank.node)]
            report = rank.shell.run_json(
                [*rank.project_python, "-m", DRY_START_MODULE, *args],
                timeout_s=DRY_START_TIMEOUT_S,
            )
            if self.runner.dry_run:
                continue
            refusal = report.get("refusal")
            if refusal:
                refused.append(role)
                self.runner.say(
                    f"    {rank.label}: vLLM refused at {refusal['step']}: {refusal['message']} "
                    f"(profile: {refusal['cause']}; fix: {refusal['fix']})"
                )
            else:
                kv = {d["name"]: d["value"] for d in report["decisions"] if d["step"] == "kv cache"}
                concurrency = next((f"{k} {v}" for k, v in kv.items() if k.startswith("max")), "")
                self.runner.say(
                    f"    {rank.label}: ok; KV cache {kv.get('tokens', '?')} tokens, {concurrency}"
                )
                for decision in report["decisions"]:  # vLLM's verdict at the measured free memory
                    if decision["step"] == "memory" and decision["name"].startswith("at "):
                        self.runner.say(f"      {decision['name']}: {decision['value']}")
        if refused:
            raise LaunchError(
                f"vLLM refuses to start on {', '.join(refused)} (its reason above); fix the "
                "profile (docs/dry-start.md)"
            )

    def _join_nodes(self, gids: dict[str, str]) -> None:
        """Both ranks all-reduce over the link the serving ranks will use, with their
        environment (link_check.py), before any weights load; a link that fails or is too slow
        stops here."""
        address = f"{self.site.head.address}:{self.site.master_port}"
        self._step(f"join both nodes at {address} with one collective (no weights loaded)")

        def join(rank: Rank) -> dict:
            plan = plan_node(self.profile, self.site, rank.node, gids[rank.node.role] or None)
            env = {k: v for k, v in plan.env.items() if k not in plan.secret_keys}
            args = ["--join", address, "--node-rank", str(rank.node.rank)]
            args += ["--timeout-s", str(LINK_TIMEOUT_S)]
            python = rank.link_python(env)
            # The rank's Python starts (an image, torch) before the collective's clock runs.
            timeout_s = LINK_TIMEOUT_S + 120
            return rank.shell.run_script(link_check.__file__, args, python, timeout_s=timeout_s)

        ranks = list(self.ranks.values())
        if self.runner.dry_run:  # the commands in order; nothing meets
            for rank in ranks:
                join(rank)
            return
        with ThreadPoolExecutor(len(ranks)) as pool:  # both ranks at once, or neither meets
            answers = list(pool.map(join, ranks))
        failed = [(rank, a) for rank, a in zip(ranks, answers, strict=True) if not a.get("ok")]
        for rank, answer in zip(ranks, answers, strict=True):
            self.runner.say(f"    {rank.label}: {answer.get('detail')}")
        if failed:
            rank, answer = failed[0]
            raise LaunchError(
                f"the nodes do not join at {address}: {rank.label}: {answer.get('detail')}; "
                "check the link between them (docs/two-node-launch.md)"
            )

    def _run_selftest(self) -> None:
        """`python -m tools.gpu_selftest` in each rank's runtime, for the site file's lane;
        every node's verdict is printed."""
        self._step("GPU self-test on both nodes (start --skip-selftest skips it)")
        args = ["--json", "--max-num-seqs", str(self.profile.max_num_seqs)]
        args += runner_args(self.site.lane)
        args += ["--draft-sample-method", self.profile.speculative.draft_sample_method]
        args += [f"--dtype={self.profile.dtype}"] if self.profile.dtype else []
        moe_backend = self.profile.serve_arg("--moe-backend")
        args += [f"--moe-backend={moe_backend}"] if moe_backend else []
        failed = []
        for role, rank in self.ranks.items():
            report = rank.shell.run_json(
                [*rank.project_python, "-m", SELFTEST_MODULE, *args],
                timeout_s=SELFTEST_TIMEOUT_S,
            )
            if self.runner.dry_run:
                continue
            self.runner.say(f"    {rank.label}: {report.get('verdict', 'no verdict')}")
            for check in report.get("checks", []):
                if check["status"] == "failed":
                    self.runner.say(f"      {check['name']}: {check['detail']}")
            if not report.get("ok") and not self._cpu_rehearsal(report):
                failed.append(role)
        if failed:
            raise LaunchError(f"GPU self-test failed on {', '.join(failed)} (details above)")

    def _cpu_rehearsal(self, report: dict) -> bool:
        """Local mode on a host without a GPU: nothing failed and the verdict says nothing was
        proved on a GPU. In the image (docker mode) a self-test that sees no GPU fails."""
        return (
            self.site.mode == "local"
            and report.get("gpu") is False
            and not any(check["status"] == "failed" for check in report.get("checks", []))
        )

    # start -----------------------------------------------------------------------------------

    def start(self, selftest: bool = True) -> None:
        self._refuse_existing()
        gids = self.preflight(selftest)
        plans = {
            role: plan_node(self.profile, self.site, rank.node, gids[role] or None)
            for role, rank in self.ranks.items()
        }
        self._step("ship env files (mode 0600)")
        for role, rank in self.ranks.items():
            plan = plans[role]
            rank.shell.write_private(rank.env_path, plan.env_file_text(), plan.env_file_text(True))
        order = (WORKER, HEAD) if self.profile.start_order == "worker-first" else (HEAD, WORKER)
        for role in order:
            self._step(f"start {self.ranks[role].label}")
            self.ranks[role].start(plans[role])
        try:
            self._wait_until_healthy()
            self._complete_one_token()
        except LaunchError:
            self._dump_logs()
            self.runner.say("==> stopping both ranks after the failure")
            self.stop()
            raise

    def _refuse_existing(self) -> None:
        states = {role: rank.state() for role, rank in self.ranks.items()}
        present = {role: state for role, state in states.items() if state.status != "absent"}
        if len(present) == 2 and all(state.healthy for state in present.values()):
            raise AlreadyRunning("both ranks are already running; `status` shows their health")
        if present:
            found = ", ".join(f"{role} {state.describe()}" for role, state in present.items())
            raise LaunchError(f"stale rank(s) found: {found}; run `dspark-launch stop` first")

    def _wait_until_healthy(self) -> None:
        self._step(f"wait for {self.api.base}/health (up to {self.site.health_timeout_s} s)")
        if self.runner.dry_run:
            return
        started = time.monotonic()
        while True:
            states = {role: rank.state() for role, rank in self.ranks.items()}
            for role, state in states.items():
                if not state.healthy:
                    raise LaunchError(f"{self.ranks[role].label} rank is {state.describe()}")
            reason = self.api.not_ready_reason()
            elapsed = time.monotonic() - started
            if reason is None:
                self.runner.say(f"    healthy after {elapsed:.0f} s")
                return
            if elapsed > self.site.health_timeout_s:
                raise LaunchError(f"not healthy after {elapsed:.0f} s: {reason}")
            last = _tail(self.ranks[HEAD], 1).strip().splitlines()
            self.runner.say(
                f"    [{elapsed:5.0f} s] ranks running; API not ready ({reason})"
                + (f"; head: {last[-1][:120]}" if last else "")
            )
            time.sleep(self.site.health_interval_s)

    def _complete_one_token(self) -> None:
        self._step(f"one-token completion through {self.api.base}")
        if self.runner.dry_run:
            return
        try:
            text = self.api.one_token_completion(self.profile.served_model_name)
        except RuntimeError as e:
            raise LaunchError(f"completion failed: {e}") from None
        self.runner.say(
            f"    ok: {text!r}; serving {self.profile.served_model_name} at "
            f"{self.site.api_bind}:{self.site.api_port}"
        )

    def _dump_logs(self) -> None:
        for rank in self.ranks.values():
            self.runner.say(f"---- last {LOG_LINES_ON_FAILURE} lines of {rank.label} ----")
            self.runner.say(_tail(rank, LOG_LINES_ON_FAILURE))

    # stop, status, logs ----------------------------------------------------------------------

    def stop(self) -> None:
        """Stop both ranks (head first); fail unless both are confirmed gone."""
        failures = []
        for role in (HEAD, WORKER):
            rank = self.ranks[role]
            self._step(f"stop {rank.label}")
            try:
                rank.stop()
            except LaunchError as e:
                failures.append(str(e))
        if failures:
            raise LaunchError("stop incomplete: " + "; ".join(failures))

    def status(self) -> ExitCode:
        """0 when both ranks run and the API answers; 1 otherwise."""
        states = {role: rank.state() for role, rank in self.ranks.items()}
        for role, state in states.items():
            self.runner.say(f"{self.ranks[role].label}: {state.describe()}")
        if self.runner.dry_run:
            self.runner.say(f"api {self.api.base}: not probed (--dry-run probes nothing)")
            return ExitCode.OK
        reason = self.api.not_ready_reason()
        self.runner.say(f"api {self.api.base}: {reason or 'healthy'}")
        healthy = all(state.healthy for state in states.values()) and reason is None
        return ExitCode.OK if healthy else ExitCode.FAILURE

    def logs(self, roles: list[str], lines: int) -> None:
        """Print each rank's last `lines` lines; fail after the others if one cannot be read."""
        failures = []
        for role in roles:
            rank = self.ranks[role]
            self.runner.say(f"---- {rank.label} ----")
            try:
                self.runner.say(rank.logs(lines))
            except LaunchError as e:
                failures.append(str(e))
        if failures:
            raise LaunchError("; ".join(failures))


def _tail(rank: Rank, lines: int) -> str:
    """The rank's last lines, or why they cannot be read (while reporting something else)."""
    try:
        return rank.logs(lines)
    except LaunchError as e:
        return f"({e})"
