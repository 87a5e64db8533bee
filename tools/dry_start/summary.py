# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""What the dry start prints: its summary for every rank of the profile, vLLM's logs in a file.

vLLM logs ~40 lines per rank while it starts; they go to a file per rank (named first on stdout),
or with `--verbose` to stderr as before. A two-node profile's second rank runs in a process of
its own beside the first (`--rank 1 --json`), so both summaries come from one command.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tools.dry_start.engine import Decision, Refusal, Report


def log_file(profile: str, device: str, rank: int) -> Path:
    return Path(tempfile.gettempdir()) / f"dspark-dry-start-{profile}-{device}-rank{rank}.log"


@contextlib.contextmanager
def logs_to(path: Path | None) -> Iterator[None]:
    """This process's stderr (vLLM's logs and tracebacks, its children's too) into `path`."""
    if path is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def start_rank(argv: list[str], rank: int, log: Path | None) -> subprocess.Popen:
    """The dry start of `rank` with the same arguments, in a process of its own."""
    stderr = open(log, "w") if log is not None else None  # noqa: SIM115 (the child holds it)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "tools.dry_start", *argv, "--rank", str(rank), "--json"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    finally:
        if stderr is not None:
            stderr.close()


def rank_report(process: subprocess.Popen, rank: int, log: Path | None) -> Report:
    """The report the process of `rank` printed as its last line."""
    out, _ = process.communicate()
    lines = out.strip().splitlines()
    try:
        data = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        report = Report(rank)
        where = f"its log: {log}" if log else "its output above"
        report.refusal = Refusal(
            "dry start", f"the dry start of rank {rank} printed no report", "-", f"read {where}"
        )
        return report
    return Report(
        rank=data["rank"],
        decisions=[Decision(**decision) for decision in data["decisions"]],
        warnings=data["warnings"],
        refusal=Refusal(**data["refusal"]) if data["refusal"] else None,
        not_run=data["not_run"],
    )
