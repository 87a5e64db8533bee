# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""What one vLLM version gets: the pinned patches parsed and the overlay files read, plus a
digest that changes whenever any of it changes (so an older install is detected as outdated)."""

import json
from dataclasses import dataclass
from pathlib import Path

from installer.hashing import sha256_hex
from installer.pins import PatchPin, Pins, PinsError, VersionPins
from installer.unified_diff import FilePatch, PatchError, parse
from installer.vllm_tree import version_assigned_in


@dataclass(frozen=True)
class PatchedFile:
    pin: PatchPin
    diff: FilePatch


@dataclass(frozen=True)
class OverlayFile:
    path: str  # path in the vLLM tree, e.g. "vllm/v1/spec_decode/dspark/ring.py"
    data: bytes


VERSION_MODULE = "vllm/v1/spec_decode/dspark/__init__.py"
"""The overlay module whose ``__version__`` is the project's release."""


@dataclass(frozen=True)
class Manifest:
    version: str
    patches: tuple[PatchedFile, ...]
    overlay: tuple[OverlayFile, ...]
    digest: str
    project_version: str | None = None
    """dspark-vllm's release, from the overlay (``VERSION_MODULE``)."""

    def patched_targets(self) -> dict[str, tuple[str, str]]:
        """Each patched file's hash before its first patch and after its last one."""
        targets: dict[str, tuple[str, str]] = {}
        for patched in self.patches:
            pin = patched.pin
            first_pre = targets[pin.target][0] if pin.target in targets else pin.pre_sha256
            targets[pin.target] = (first_pre, pin.post_sha256)
        return targets


def build(project: Path, pins: Pins, version_pins: VersionPins) -> Manifest:
    patches = tuple(_read_patch(project, pin) for pin in version_pins.patches)
    overlay = tuple(
        OverlayFile(path, (project / "overlay" / path).read_bytes()) for path in pins.overlay
    )
    identity = {
        "version": version_pins.version,
        "patches": [
            {
                "target": patched.pin.target,
                "pre_sha256": patched.pin.pre_sha256,
                "post_sha256": patched.pin.post_sha256,
            }
            for patched in patches
        ],
        "overlay": [{"path": file.path, "sha256": sha256_hex(file.data)} for file in overlay],
    }
    digest = sha256_hex(json.dumps(identity, sort_keys=True).encode())
    release = next(
        (version_assigned_in(f.data.decode()) for f in overlay if f.path == VERSION_MODULE), None
    )
    return Manifest(version_pins.version, patches, overlay, digest, release)


def _read_patch(project: Path, pin: PatchPin) -> PatchedFile:
    try:
        diff = parse((project / pin.patch).read_bytes())
    except (OSError, PatchError) as error:
        raise PinsError(f"cannot use {pin.patch}: {error}") from error
    if diff.old_path != pin.target or diff.new_path != pin.target:
        raise PinsError(
            f"{pin.patch} changes {diff.old_path} but recipe/pins.yaml lists it for {pin.target}"
        )
    return PatchedFile(pin, diff)
