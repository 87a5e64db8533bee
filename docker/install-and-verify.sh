#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
# Install the DSpark overlay into a Python environment's vLLM and prove that it took.
#
# Every image build runs exactly this script (docker/*.Dockerfile), and CI runs it against the CPU
# test environment, so the steps an image takes are the steps tested here. It fails (non-zero) when
# install.py fails, when `install.py --status` does not report a complete install, or when a DSpark
# module listed in the manifest (recipe/pins.yaml) does not import from the patched vLLM.
#
# usage: docker/install-and-verify.sh PYTHON [VLLM_PATH]
#   PYTHON     interpreter whose vLLM is patched (it also runs install.py and the imports)
#   VLLM_PATH  a vllm package directory to patch instead of PYTHON's own (tests use a copy)
# Optional checks, set by the Dockerfiles from their build arguments:
#   EXPECT_VLLM_VERSION  the vLLM version the image is labelled with
#   EXPECT_PIN_DIGEST    the pin digest the image is labelled with
set -euo pipefail

fail() {
    printf 'install-and-verify: %s\n' "$1" >&2
    exit 1
}

if (($# < 1 || $# > 2)); then
    printf 'usage: %s PYTHON [VLLM_PATH]\n' "$0" >&2
    exit 2
fi
python=$1
command -v "$python" >/dev/null || fail "no Python interpreter '$python'"
root=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)

target=()
if (($# == 2)); then
    target=(--vllm-path "$2")
fi

"$python" "$root/install.py" "${target[@]}" || fail "install.py failed (exit $?); see its message above"
"$python" "$root/install.py" "${target[@]}" --status ||
    fail "install.py --status does not report a complete install (exit $?)"
"$python" "$root/docker/verify_install.py" "${target[@]}" \
    --expect-vllm-version "${EXPECT_VLLM_VERSION:-}" --expect-pin-digest "${EXPECT_PIN_DIGEST:-}"
