# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The GPU code a shared object carries, read from its CUDA fat binaries without cuobjdump.

    python -m tools.fatbin FILE.so|WHEEL.whl [--json]

A wheel's listing is cached beside it (`WHEEL.fatbins.json`).

nvcc embeds one fat binary per translation unit in the ELF section `.nv_fatbin` (what the CUDA
runtime loads) and, for relocatable device code, in `__nv_relfatbin` (an input of the device
link). A fat binary is a 16-byte header (magic 0xBA55ED50, version, header size, payload size)
followed by entries, each with a header of its own: kind (1 PTX, 2 ELF with SASS), the
architecture number and flags. Read from binaries nvcc 13.0 wrote for each target
(`tests/tools/test_fatbin.py` builds them), the flags say:

- 0x100000: architecture-specific code (`sm_90a`, `compute_120a`);
- 0x200000: family code (`sm_100f`, runs on 10.x with x >= 0);
- 0x2000, 0x8000: the payload is compressed (LZ4, zstd); the header stays readable.

The architecture is read from the entry header only, so compressed payloads need no
decompressor.
"""

from __future__ import annotations

import argparse
import json
import re
import struct
import sys
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = 0xBA55ED50
SECTIONS = (".nv_fatbin", "__nv_relfatbin")
KIND_PTX, KIND_SASS = 1, 2
FLAG_ARCH_SPECIFIC = 0x100000
FLAG_FAMILY = 0x200000
FLAG_COMPRESSED = 0x2000 | 0x8000

_FATBIN_HEADER = struct.Struct("<IHHQ")
# kind, unknown, header size, payload size, compressed size, unknown, minor, major, arch,
# name offset, name length, flags, zero, size once decompressed
_ENTRY_HEADER = struct.Struct("<HHIQIIHHIIIQQQ")


class FatbinError(ValueError):
    """The bytes are not a well-formed ELF file or fat binary."""


@dataclass(frozen=True)
class Entry:
    """One image in a fat binary: SASS for `sm_XY[a|f]` or PTX for `compute_XY[a|f]`."""

    kind: int
    arch: str
    compressed: bool
    size: int
    """Bytes once decompressed."""

    @property
    def is_ptx(self) -> bool:
        return self.kind == KIND_PTX


@dataclass(frozen=True)
class Fatbin:
    section: str
    entries: tuple[Entry, ...]

    @property
    def sass(self) -> list[str]:
        return sorted({e.arch for e in self.entries if not e.is_ptx}, key=arch_key)

    @property
    def ptx(self) -> list[str]:
        return sorted({e.arch for e in self.entries if e.is_ptx}, key=arch_key)

    @property
    def ptx_bytes(self) -> int:
        """What the driver compiles when it JIT-compiles this module's PTX (once decompressed)."""
        return sum(e.size for e in self.entries if e.is_ptx)


@dataclass
class Listing:
    """What one shared object carries: every fat binary of `.nv_fatbin` (the relocatable ones
    counted apart), and the union of their SASS and PTX architectures."""

    fatbins: list[Fatbin] = field(default_factory=list)
    relocatable: int = 0

    @property
    def sass(self) -> list[str]:
        return sorted({a for f in self.fatbins for a in f.sass}, key=arch_key)

    @property
    def ptx(self) -> list[str]:
        return sorted({a for f in self.fatbins for a in f.ptx}, key=arch_key)

    def as_json(self) -> dict:
        """The union, and the fat binaries grouped by what they carry (count, PTX bytes)."""
        variants: dict[tuple, Counter] = {}
        for f in self.fatbins:
            group = variants.setdefault((tuple(f.sass), tuple(f.ptx)), Counter())
            group["count"] += 1
            group["ptx_bytes"] += f.ptx_bytes
        return {
            "sass": self.sass,
            "ptx": self.ptx,
            "fatbins": len(self.fatbins),
            "relocatable_fatbins": self.relocatable,
            "by_fatbin": [
                {"sass": list(sass), "ptx": list(ptx), **group}
                for (sass, ptx), group in sorted(variants.items())
            ],
        }


def arch_key(arch: str) -> tuple[int, str]:
    digits = "".join(c for c in arch.split("_", 1)[-1] if c.isdigit())
    return int(digits or 0), arch


def elf_sections(data: bytes) -> dict[str, tuple[int, int]]:
    """{name: (file offset, size)} of the sections of a 64-bit little-endian ELF file that hold
    bytes in it."""
    if data[:4] != b"\x7fELF" or data[4:6] != b"\x02\x01":
        raise FatbinError("not a 64-bit little-endian ELF file")
    try:
        (shoff,) = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
        headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
        names = headers[shstrndx][4]
    except (struct.error, IndexError) as error:
        raise FatbinError(f"ELF section headers cut short (a truncated file?): {error}") from error
    sections = {}
    for name, kind, _flags, _addr, offset, size in headers:
        label = data[names + name : data.find(b"\0", names + name)].decode("latin-1")
        if kind != 8:  # SHT_NOBITS holds no bytes in the file
            if offset + size > len(data):
                raise FatbinError(f"ELF section {label} runs past the end of the file")
            sections[label] = (offset, size)
    return sections


def walk(section: memoryview, name: str) -> list[Fatbin]:
    """The fat binaries laid end to end in one section (zero padding between them allowed)."""
    fatbins = []
    position, end = 0, len(section)
    while position < end:
        if position + _FATBIN_HEADER.size > end:
            if any(section[position:end]):
                raise FatbinError(f"{name}: {end - position} stray bytes at offset {position}")
            break
        magic, _version, header_size, size = _FATBIN_HEADER.unpack_from(section, position)
        if magic == 0:  # padding to the next fat binary
            position += 8
            continue
        if magic != MAGIC:
            raise FatbinError(f"{name}: no fat binary magic at offset {position} ({magic:#x})")
        start, stop = position + header_size, position + header_size + size
        if stop > end:
            raise FatbinError(
                f"{name}: the fat binary at offset {position} claims {size} bytes, "
                f"the section holds {end - start}"
            )
        fatbins.append(Fatbin(name, tuple(entries(section[start:stop], name, start))))
        position = stop
    return fatbins


def entries(payload: memoryview, name: str, base: int) -> list[Entry]:
    found, position = [], 0
    while position < len(payload):
        if position + _ENTRY_HEADER.size > len(payload):
            raise FatbinError(f"{name}: an entry header cut short at offset {base + position}")
        fields = _ENTRY_HEADER.unpack_from(payload, position)
        kind, header_size, size, number, flags, decompressed = (
            fields[0],
            fields[2],
            fields[3],
            fields[8],
            fields[11],
            fields[13],
        )
        if kind not in (KIND_PTX, KIND_SASS) or header_size < _ENTRY_HEADER.size:
            raise FatbinError(
                f"{name}: entry at offset {base + position} has kind {kind} and header size "
                f"{header_size}, neither PTX (1) nor SASS (2)"
            )
        if position + header_size + size > len(payload):
            raise FatbinError(f"{name}: entry at offset {base + position} runs past its fat binary")
        suffix = "a" if flags & FLAG_ARCH_SPECIFIC else "f" if flags & FLAG_FAMILY else ""
        prefix = "compute" if kind == KIND_PTX else "sm"
        compressed = bool(flags & FLAG_COMPRESSED)
        unpacked = decompressed if compressed else size
        found.append(Entry(kind, f"{prefix}_{number}{suffix}", compressed, unpacked))
        position += header_size + size
    return found


def read(data: bytes) -> Listing:
    """Every fat binary of a shared object's bytes; an ELF file without one lists nothing."""
    sections = elf_sections(data)
    listing = Listing()
    for name in SECTIONS:
        if name in sections:
            offset, size = sections[name]
            found = walk(memoryview(data)[offset : offset + size], name)
            if name == SECTIONS[0]:
                listing.fatbins.extend(found)
            else:
                listing.relocatable += len(found)
    return listing


def read_wheel(wheel: Path, members: list[str] | None = None) -> dict[str, Listing]:
    """{member: listing} for the shared objects of a wheel (`members`, else every `.so`)."""
    with zipfile.ZipFile(wheel) as archive:
        names = members or [n for n in archive.namelist() if n.endswith(".so")]
        return {name: read(archive.read(name)) for name in names}


def wheel_listing(wheel: Path) -> dict[str, dict]:
    """{member: `Listing.as_json()`} of every shared object in `wheel`, cached beside it as
    `WHEEL.fatbins.json` (reading a CUDA wheel's 660 MB of binaries takes tens of seconds)."""
    cache = wheel.with_name(wheel.name + ".fatbins.json")
    if cache.is_file() and cache.stat().st_mtime >= wheel.stat().st_mtime:
        return json.loads(cache.read_text())
    listing = {name: entry.as_json() for name, entry in read_wheel(wheel).items()}
    partial = cache.with_suffix(".partial")
    partial.write_text(json.dumps(listing, indent=1, sort_keys=True))
    partial.replace(cache)
    return listing


# --- which code runs on a device (CUDA's compatibility rules) ---------------------------------

_ARCH = re.compile(r"\b(sm|compute)_(\d+)([af]?)\b")
NATIVE, PTX_JIT, NONE = "sass", "ptx-jit", "none"


def parse_arch(text: str) -> tuple[int, int, str] | None:
    """`sm_121a` -> (12, 1, "a"); `compute_90` -> (9, 0, ""); anything else -> None."""
    match = _ARCH.search(text)
    if not match:
        return None
    number = int(match[2])
    return number // 10, number % 10, match[3]


def code_runs_on(code: tuple[int, int, str], device: tuple[int, int]) -> bool:
    """Whether SASS built for `code` loads on a device of compute capability `device`.

    CUDA's rules: plain code for X.y runs on X.z with z >= y; `a` (architecture-specific) code
    only on exactly X.y; `f` (family) code on X.z with z >= y.
    """
    major, minor, suffix = code
    if suffix == "a":
        return (major, minor) == device
    return major == device[0] and minor <= device[1]


def ptx_runs_on(code: tuple[int, int, str], device: tuple[int, int]) -> bool:
    """Plain PTX compiles for any later device; `a`/`f` PTX only where its SASS would run."""
    major, minor, suffix = code
    if suffix:
        return code_runs_on(code, device)
    return (major, minor) <= device


def arch_verdict(sass: list[str], ptx: list[str], device: tuple[int, int]) -> str:
    """NATIVE, PTX_JIT or NONE for one fat binary's (or a union's) architectures on `device`."""
    if any((c := parse_arch(a)) and code_runs_on(c, device) for a in sass):
        return NATIVE
    if any((c := parse_arch(a)) and ptx_runs_on(c, device) for a in ptx):
        return PTX_JIT
    return NONE


def coverage(listing: dict, device: tuple[int, int]) -> Counter:
    """How many of a library's fat binaries (one per translation unit) are NATIVE, PTX_JIT or
    NONE on `device`, from `Listing.as_json()`."""
    counts: Counter = Counter()
    for variant in listing["by_fatbin"]:
        counts[arch_verdict(variant["sass"], variant["ptx"], device)] += variant["count"]
    return counts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.fatbin", description=__doc__.split("\n")[0]
    )
    parser.add_argument("paths", nargs="+", type=Path, help="shared objects or wheels")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    options = parser.parse_args(argv)
    listings: dict[str, dict] = {}
    try:
        for path in options.paths:
            if path.suffix == ".whl":
                listings |= {f"{path.name}:{k}": v for k, v in wheel_listing(path).items()}
            else:
                listings[str(path)] = read(path.read_bytes()).as_json()
    except (OSError, zipfile.BadZipFile, FatbinError) as error:
        print(f"fatbin: {error}", file=sys.stderr)
        return 2
    if options.json:
        print(json.dumps(listings, indent=1))
        return 0
    for name, entry in listings.items():
        sass, ptx = " ".join(entry["sass"]) or "-", " ".join(entry["ptx"]) or "-"
        print(f"{name}: {entry['fatbins']} fat binaries; SASS {sass}; PTX {ptx}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
