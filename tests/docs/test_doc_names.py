# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Every repository file and Python module that README.md, CONTRIBUTING.md and docs/*.md name
exists: a path in backticks or a link target, a module as ``package.module`` (an attribute after
it, like ``dspark_fixtures.engine.TinyEngine``, must be defined there).

Names are read from code spans and links only. A path counts as the repository's when its first
part is a tracked top-level entry (``tools/...``, ``docs/...``, ``Makefile``); a ``vllm/...`` path
or ``vllm.`` module is looked up in the overlay, then in the installed vLLM; other spans (shell
commands, vLLM-relative paths, flags) are not names of this repository.
"""

import ast
import importlib.util
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / "overlay"
DOCS = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", *(REPO / "docs").glob("*.md")])

CODE_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
# A path: no spaces, no shell or glob syntax, optional `:line` or `#anchor` after it.
PATH = re.compile(r"^(?P<path>[\w.@-]+(?:/[\w.@-]*)*)(?::\d+(?:-\d+)?|#[\w-]*)?$")
MODULE = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")
FILE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".patch", ".txt", ".Dockerfile")


@cache
def top_level() -> frozenset[str]:
    """Tracked top-level files and folders, and the packages under ``launch/``."""
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    return frozenset(name.split("/")[0] for name in files)


@cache
def known_files() -> tuple[str, ...]:
    """The repository's tracked files and the installed vLLM's, as paths from their roots."""
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    root = vllm_root()
    return (*files, *(str(p.relative_to(root)) for p in (root / "vllm").rglob("*.py")))


@cache
def known_folders() -> frozenset[str]:
    return frozenset(part for name in known_files() for part in name.split("/")[:-1])


@cache
def vllm_root() -> Path:
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))).parent


@cache
def package_roots() -> dict[str, Path]:
    """Top-level importable names of the repository, with the folder that holds each."""
    roots = {name: REPO for name in top_level() if (REPO / name / "__init__.py").exists()}
    roots |= {p.parent.name: REPO / "launch" for p in (REPO / "launch").glob("*/__init__.py")}
    return roots


def module_file(base: Path, parts: list[str]) -> Path | None:
    path = base.joinpath(*parts)
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return path if path.is_dir() else None


def defines(module: Path, name: str) -> bool:
    """Whether ``module`` (a file) binds ``name`` at its top level."""
    if module.is_dir():
        return (module / name).is_dir() or (module / f"{name}.py").is_file()
    if module.name == "__init__.py" and module_file(module.parent, [name]) is not None:
        return True
    tree = ast.parse(module.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == name:
                return True
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            if node.id == name:
                return True
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and any(
            (a.asname or a.name.split(".")[0]) == name for a in node.names
        ):
            return True
    return False


def module_problem(name: str) -> str | None:
    """Why the dotted ``name`` names nothing, or None; None too for names not of this repo."""
    parts = name.split(".")
    if parts[0] == "vllm":
        bases = [OVERLAY, vllm_root()]
        if not any(module_file(base, parts[:2]) for base in bases):
            return None  # not a module: an entry-point group such as vllm.general_plugins
    elif parts[0] in package_roots():
        bases = [package_roots()[parts[0]]]
    else:
        return None
    for count in range(len(parts), 0, -1):
        for base in bases:
            module = module_file(base, parts[:count])
            if module is None:
                continue
            rest = parts[count:]
            if not rest or defines(module, rest[0]):
                return None
            return f"`{name}`: {'.'.join(parts[:count])} defines no {rest[0]}"
    return f"`{name}`: no such module"


def exists(base: Path, path: str) -> bool:
    """``path`` under ``base``; a ``...`` part stands for any run of folders."""
    return any(base.glob(path.replace("...", "**"))) if "..." in path else (base / path).exists()


@cache
def ignored(path: str) -> bool:
    """What git ignores is output (``benchmarks/results/``), not a file of the repository."""
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0


def path_problem(doc: Path, text: str, *, link: bool) -> str | None:
    match = PATH.match(text)
    if match is None:
        return None
    path = match["path"].rstrip("/")
    parts = path.split("/")
    if parts[0] == "vllm" and len(parts) > 1:
        roots = [OVERLAY, vllm_root()]
        if not any((root / "vllm" / parts[1] / "__init__.py").exists() for root in roots):
            return None  # outside vLLM's packages: an image (vllm/vllm-openai), install state
        found = any(exists(root, path) for root in roots)
        return None if found else f"`{text}`: not in the overlay or the installed vLLM"
    if parts[0] in top_level():
        found = exists(REPO, path) or ignored(match["path"])
        return None if found else f"`{text}`: no such file"
    if link and path.endswith(FILE_SUFFIXES):  # relative to the document
        return None if (doc.parent / path).exists() else f"({text}): no such file"
    if len(parts) > 1 and path.endswith(FILE_SUFFIXES) and parts[0] in known_folders():
        # a tail such as dspark/spec.py
        found = any(name.endswith("/" + path) for name in known_files())
        return None if found else f"`{text}`: no repository or vLLM file ends so"
    return None


def problems(doc: Path) -> list[str]:
    text = FENCE.sub("", doc.read_text(encoding="utf-8"))
    found = []
    for span in CODE_SPAN.findall(text):
        span = span.strip()
        problem = path_problem(doc, span, link=False)
        name = re.sub(r"\(.*\)$", "", span)  # a call: dspark_launch.lanes.runner_args(lane)
        if problem is None and MODULE.match(name) and not name.endswith(FILE_SUFFIXES):
            problem = module_problem(name)
        if problem:
            found.append(problem)
    for target in LINK.findall(text):
        if not re.match(r"^[a-z]+:", target) and not target.startswith("#"):
            found.append(path_problem(doc, target, link=True) or "")
    return [p for p in found if p]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_named_file_and_module_exists(doc):
    assert problems(doc) == [], f"{doc.relative_to(REPO)} names what does not exist"


def test_a_misnamed_file_module_or_link_is_found(tmp_path):
    """The control: one bad name of each kind, beside good ones."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "`tools/dry_start/engine.py`, `tools/no_such_tool.py`, `tools.dry_start`, "
        "`tools.dry_startt`, `dspark_fixtures.engine.TinyEngine`, `dspark_fixtures.engine.NoSuch`, "
        "`vllm.v1.spec_decode.dspark.checks`, `vllm/v1/spec_decode/no_such.py`, "
        "`overlay/.../dspark/checks.py`, `overlay/.../dspark/no_such.py`, `dspark/spec.py`, "
        "`dspark/no_such.py`, `tools.dry_start.engine.refusal(x)`, "
        "`tools.dry_start.no_such(argv)`, "
        "[a](missing-notes.md), [b](https://example.com/x.md), `make test-fast`\n"
        "```\ntools/inside_a_fence.py\n```\n"
    )
    assert problems(doc) == [
        "`tools/no_such_tool.py`: no such file",
        "`tools.dry_startt`: tools defines no dry_startt",
        "`dspark_fixtures.engine.NoSuch`: dspark_fixtures.engine defines no NoSuch",
        "`vllm/v1/spec_decode/no_such.py`: not in the overlay or the installed vLLM",
        "`overlay/.../dspark/no_such.py`: no such file",
        "`dspark/no_such.py`: no repository or vLLM file ends so",
        "`tools.dry_start.no_such`: tools.dry_start defines no no_such",
        "(missing-notes.md): no such file",
    ]
