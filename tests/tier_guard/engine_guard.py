# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Records every vLLM engine and vLLM subprocess a unit-tier test starts.

The engine constructors (`LLM`, `AsyncLLM`, `EngineCore`, which every engine process runs) are
wrapped when their modules load: while `RECORD_ENV` names a file, a constructor appends a line
to it and raises. A child process gets the guard through the `sitecustomize` beside this file,
put on its `PYTHONPATH` by `guard_child_env`, and there importing `vllm` at all is recorded: a
vLLM subprocess (its CLI, a config built in a probe) is the `multiproc` tier's. tests/conftest.py
fails the test when the file is not empty, so an error the test swallows still fails it.
"""

import functools
import os
import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from pathlib import Path

RECORD_ENV = "DSPARK_UNIT_TIER_RECORD"
# vLLM's model registry inspects an architecture in a child the first time it meets it (until
# its cache holds it): a config being built, not an engine, so a unit test may cause it.
REGISTRY_PROBE = ["-m", "vllm.model_executor.models.registry"]
GUARD_DIR = str(Path(__file__).resolve().parent)
ENGINES = {
    "vllm.entrypoints.llm": "LLM",
    "vllm.v1.engine.async_llm": "AsyncLLM",
    "vllm.v1.engine.core": "EngineCore",
}


def _guard(cls: type) -> None:
    init = cls.__init__

    @functools.wraps(init)
    def guarded_init(self, *args, **kwargs):
        if os.environ.get(RECORD_ENV):
            _record(f"{cls.__name__} started")
            raise RuntimeError(f"a unit-tier test may not start a vLLM engine ({cls.__name__})")
        init(self, *args, **kwargs)

    cls.__init__ = guarded_init  # type: ignore[misc]


def _record(line: str) -> None:
    with open(os.environ[RECORD_ENV], "a", encoding="utf-8") as file:
        file.write(f"{line} (process {os.getpid()}: {' '.join(sys.orig_argv)[:200]})\n")


class _EngineModules(MetaPathFinder):
    """Wraps the engine class of each module in `ENGINES` right after the module runs; in a
    child process, records the import of `vllm`."""

    def __init__(self, child: bool) -> None:
        self.child = child

    def find_spec(self, name, path, target=None) -> ModuleSpec | None:
        if self.child and name == "vllm" and os.environ.get(RECORD_ENV) and not _registry_probe():
            _record("vllm imported in a subprocess")
        if name not in ENGINES:
            return None
        for finder in sys.meta_path:
            if _is_guard(finder) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module, run=run):
                    run(module)
                    _guard(getattr(module, ENGINES[name]))

                spec.loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec
        return None


def _registry_probe() -> bool:
    return sys.orig_argv[1:3] == REGISTRY_PROBE


def _is_guard(finder: object) -> bool:
    """By name: a child started by a guarded test imports this file as `engine_guard` too."""
    return type(finder).__name__ == _EngineModules.__name__


def install(child: bool = False) -> None:
    """Wrap the engine classes already imported, and the others when they load; ``child``: in
    a process a unit-tier test started."""
    if any(map(_is_guard, sys.meta_path)):
        return
    for name, cls in ENGINES.items():
        if name in sys.modules:
            _guard(getattr(sys.modules[name], cls))
    sys.meta_path.insert(0, _EngineModules(child))


def guard_child_env(env: dict[str, str], record: str) -> dict[str, str]:
    """`env` for a child process, with the guard on its path and the record file named."""
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, RECORD_ENV: record, "PYTHONPATH": os.pathsep.join([*paths, GUARD_DIR])}
