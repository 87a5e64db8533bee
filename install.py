#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Install the DSpark overlay and patches into a vLLM tree, transactionally and version-pinned."""

import argparse
import sys
from pathlib import Path

try:
    import json
    import os

    from installer import commands, faults
    from installer.errors import ExitCode, InstallerError
    from installer.vllm_tree import locate
except ModuleNotFoundError as missing:  # pyyaml or packaging: both are vLLM dependencies
    sys.exit(
        f"install.py: error: the Python module {missing.name!r} is missing. Run install.py "
        f"with the Python of your vLLM environment, or `pip install pyyaml packaging`."
    )
except KeyboardInterrupt:
    sys.exit("install.py: interrupted before it started; nothing was changed")

PROJECT = Path(__file__).resolve().parent

EPILOG = """\
exit codes:
  0  installed (or already installed; uninstall: restored or nothing to do)
  1  failed: nothing was changed, or every change was rolled back and verified
  2  bad arguments, or the path is not a vLLM tree
  3  refused: unsupported vLLM version, a file differs from its pinned hash or from
     vLLM's RECORD, or installed files drifted; nothing was changed
  4  rollback failed: the journal is kept, manual repair needed (see the message)
  --status only:
  5  not installed    6  partial (interrupted, outdated or incomplete)    7  drifted

A run that was killed leaves a journal; the next run of any mode (except --dry-run)
rolls the tree back to exactly its state before the killed run.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="install.py",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--vllm-path",
        type=Path,
        help="the directory that contains the `vllm` package (e.g. site-packages), or the "
        "`vllm` package directory itself; default: the vllm of the Python running this script, "
        "found without importing it",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--status", action="store_true", help="report the install state")
    mode.add_argument(
        "--uninstall", action="store_true", help="restore vLLM's original files byte for byte"
    )
    mode.add_argument(
        "--dry-run", action="store_true", help="print what would change; write nothing"
    )
    parser.add_argument("--json", action="store_true", help="with --status: print JSON")
    parser.add_argument(
        "--force",
        action="store_true",
        help="with --uninstall: also restore files that were changed after install",
    )
    args = parser.parse_args(argv)
    if args.json and not args.status:
        parser.error("--json needs --status")
    if args.force and not args.uninstall:
        parser.error("--force needs --uninstall")
    try:
        faults.check_env()
    except faults.FaultSpecError as error:
        parser.error(str(error))
    try:
        tree = locate(args.vllm_path)
        if args.status:
            status = commands.status(tree, PROJECT)
            print(status.to_json() if args.json else status.to_text())
            sys.stdout.flush()  # here, so that a closed pipe is handled below
            return status.exit_code
        if args.uninstall:
            return commands.uninstall(tree, PROJECT, args.force)
        return commands.install(tree, PROJECT, args.dry_run)
    except BrokenPipeError:
        # A reader such as `head` left: stop quietly, and let no flush at exit complain.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.FAILED
    except InstallerError as error:
        return _fail(str(error), error.exit_code, args.status and args.json)
    except OSError as error:
        return _fail(str(error), ExitCode.FAILED, args.status and args.json)
    except KeyboardInterrupt:
        # Inside a commit, commit() rolls back and reports an InstallerError instead; outside
        # one nothing was written beyond vllm/.dspark-install, which the next run sweeps.
        print(
            "install.py: interrupted; no change is left half-done (a journal left behind is "
            "rolled back by the next run); `install.py --status` shows the state",
            file=sys.stderr,
        )
        return ExitCode.FAILED


def _fail(message: str, code: ExitCode, as_json: bool) -> int:
    """Report on stderr; `--status --json` readers (the launcher, the image check) also get a
    JSON answer on stdout, with the state "error"."""
    print(f"install.py: error: {message}", file=sys.stderr)
    if as_json:
        print(json.dumps({"state": "error", "error": message, "exit_code": int(code)}))
    return code


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # between main's own handlers, e.g. while printing
        sys.exit("install.py: interrupted; `install.py --status` shows the state")
