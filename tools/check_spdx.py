#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Check (or with --fix, add) the SPDX header of every Python, shell, Dockerfile and Makefile in
the repository.

Files under overlay/ land inside vLLM's tree and carry vLLM's own two lines, as every vLLM file
does; the project's other files name this project. The header follows a shebang line.

    python tools/check_spdx.py [--fix] [FILE ...]    # default: every tracked file
"""

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LICENSE_LINE = "# SPDX-License-Identifier: Apache-2.0"
VLLM_COPYRIGHT = "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project"
PROJECT_COPYRIGHT = "# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project"
SHEBANGS = ("#!/usr/bin/env python3", "#!/usr/bin/env bash", "#!/bin/sh", "#!/bin/bash")


def header(relpath: str) -> list[str]:
    copyright_line = VLLM_COPYRIGHT if relpath.startswith("overlay/") else PROJECT_COPYRIGHT
    return [LICENSE_LINE, copyright_line]


def wants_header(path: Path) -> bool:
    if path.suffix in (".py", ".sh", ".Dockerfile") or path.name == "Makefile":
        return True
    if path.suffix or not path.is_file():
        return False
    with path.open("rb") as handle:
        first = handle.readline().decode(errors="replace").rstrip("\n")
    return first in SHEBANGS


def tracked_files() -> list[str]:
    listing = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout
    return [name for name in listing.decode().split("\0") if name]


def problem(relpath: str, fix: bool) -> str | None:
    """What is wrong with the file's header (None: nothing); with ``fix``, repair it."""
    path = REPO / relpath
    text = path.read_text()
    lines = text.split("\n")
    start = 1 if lines and lines[0].startswith("#!") else 0
    wanted = header(relpath)
    if lines[start : start + 2] == wanted:
        return None
    if not fix:
        return f"{relpath}: the first lines must be\n  " + "\n  ".join(wanted)
    present = [line for line in lines[start : start + 2] if line.startswith("# SPDX-")]
    body = lines[start + len(present) :]
    path.write_text("\n".join([*lines[:start], *wanted, *body]))
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fix", action="store_true", help="add or correct the headers")
    parser.add_argument("files", nargs="*", help="files to check (default: every tracked file)")
    args = parser.parse_args(argv)
    names = [str(Path(f).resolve().relative_to(REPO)) for f in args.files] or tracked_files()
    problems = [p for name in names if wants_header(REPO / name) and (p := problem(name, args.fix))]
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
