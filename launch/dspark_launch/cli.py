# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""`dspark-launch`: command line, configuration loading and exit codes."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dspark_common.operator_input import escaped, shown
from dspark_launch.errors import ConfigError, ExitCode, LaunchError

MAX_LOG_LINES = 1_000_000
EPILOG = """\
exit codes:
  0  ok
  1  failure: a check failed, a rank exited or restarted, a node is unreachable,
     the server did not become healthy, or stop could not confirm a rank is gone
  2  bad configuration (site file, profile or state_dir), or PyYAML missing;
     nothing was run
  3  already running (start only; both ranks are up)
"""


def _line_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_LOG_LINES:
        raise argparse.ArgumentTypeError(
            f"{shown(text)} is not a line count from 1 to {MAX_LOG_LINES}"
        )
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dspark-launch",
        description="Serve a model with vLLM on two nodes (tensor parallel across --nnodes 2).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--site",
        type=Path,
        default=os.environ.get("DSPARK_SITE") or None,  # set but empty counts as unset
        help="the site file (default: $DSPARK_SITE)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print every command that would run (secrets redacted) and run none",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("preflight", help="check both nodes without starting anything")
    start = commands.add_parser("start", help="preflight, start both ranks, wait until serving")
    start.add_argument(
        "--skip-selftest",
        action="store_true",
        help="do not run the GPU self-test (tools/gpu_selftest.py) on the nodes first",
    )
    commands.add_parser("stop", help="stop both ranks (idempotent)")
    commands.add_parser("status", help="show both ranks and the API (exit 0 only when healthy)")
    logs = commands.add_parser("logs", help="print the ranks' recent log lines")
    logs.add_argument("--node", choices=("head", "worker", "both"), default="both")
    logs.add_argument("-n", "--lines", type=_line_count, default=100, help="lines per rank, N >= 1")
    return parser


def run(args: argparse.Namespace) -> ExitCode:
    if args.site is None:
        empty = " (DSPARK_SITE is set but empty)" if "DSPARK_SITE" in os.environ else ""
        raise ConfigError(f"no site file{empty}: pass --site FILE or set DSPARK_SITE")
    # Imported here so that `--help` and the missing-PyYAML message need no PyYAML.
    from dspark_launch.launcher import Launcher
    from dspark_launch.profile import load_profile, resolve_profile_path
    from dspark_launch.runner import Runner
    from dspark_launch.site import check_compatible, load_site

    site = load_site(args.site)
    profile = load_profile(resolve_profile_path(site.profile, site.path.parent))
    check_compatible(site, profile)
    launcher = Launcher(site, profile, Runner(dry_run=args.dry_run))
    if args.command == "preflight":
        launcher.preflight()
    elif args.command == "start":
        launcher.start(selftest=not args.skip_selftest)
    elif args.command == "stop":
        launcher.stop()
    elif args.command == "status":
        return launcher.status()
    else:
        launcher.logs(["head", "worker"] if args.node == "both" else [args.node], args.lines)
    return ExitCode.OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = run(args)
        sys.stdout.flush()  # here, so that a closed pipe is handled below, not at exit
        return code
    except LaunchError as e:
        return _fail(args.command, str(e), e.exit_code)
    except KeyboardInterrupt:
        return _fail(args.command, "interrupted", ExitCode.FAILURE)
    except BrokenPipeError:
        # A reader such as `head` left: stop quietly, and let no flush at exit complain.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return ExitCode.FAILURE
    except ModuleNotFoundError as e:
        if e.name != "yaml":
            raise
        return _fail(
            args.command,
            f"the Python module 'yaml' (PyYAML) is missing from {sys.executable}: install it "
            "with `sudo apt install python3-yaml` or `python3 -m pip install pyyaml`",
            ExitCode.BAD_CONFIG,
        )
    except OSError as e:
        where = f" ({escaped(str(e.filename))})" if e.filename else ""
        return _fail(args.command, f"{escaped(e.strerror or str(e))}{where}", ExitCode.FAILURE)


def _fail(command: str, message: str, code: ExitCode) -> int:
    print(f"dspark-launch {command}: {message}", file=sys.stderr)
    return code
