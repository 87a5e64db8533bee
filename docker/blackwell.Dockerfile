# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
# DSpark vLLM image for x86_64 Blackwell servers: B200-class GPUs (compute capability 10.0, sm_100a)
# and RTX PRO 6000 Blackwell-class GPUs (12.0, sm_120a), CUDA 13. Grace-hosted GB200 systems are
# aarch64 and not covered by this file. Build and run: docs/docker.md.
#
# No "# syntax=" line on purpose: it makes every build fetch the docker/dockerfile frontend from
# Docker Hub, so an offline build (CI, air-gapped hosts) fails before its first step. Everything
# here works with the frontend built into Docker (BuildKit or the classic builder).
#
# Base: the official vLLM OpenAI server image, named by one full reference. Its release tags are
# multi-arch (linux/amd64 and linux/arm64) and, since vLLM 0.20.0, the unsuffixed tag is the CUDA
# 13.0 build. The vLLM in it must be a version recipe/pins.yaml supports; install.py refuses any
# other, and so does the build. A tag alone is mutable, so the build refuses a BASE without a
# digest unless ALLOW_UNPINNED_BASE=1 (the CPU stand-in test does that with a local image).
#
# Updating the base:
#   1. choose a vLLM version listed in recipe/pins.yaml; set BASE's tag and VLLM_VERSION to it;
#   2. docker buildx imagetools inspect vllm/vllm-openai:vX.Y.Z   (the top "Digest:" line);
#   3. pass --build-arg BASE=vllm/vllm-openai:vX.Y.Z@sha256:... (or make it the default below, once
#      a maintainer has read the digest from the registry; none was recorded when this was written).
ARG BASE=vllm/vllm-openai:v0.33.0
# The platform of BASE to build on. The CPU stand-in test passes the host's, to build these
# steps on x86_64; the image it makes is a test artifact, not this target's image.
ARG BASE_PLATFORM=linux/amd64

# hadolint ignore=DL3029
FROM --platform=${BASE_PLATFORM} ${BASE}

ARG BASE
ARG ALLOW_UNPINNED_BASE=""
RUN case "${BASE}" in \
        *@sha256:????????????????????????????????????????????????????????????????) ;; \
        *) if [ "${ALLOW_UNPINNED_BASE}" != 1 ]; then \
               echo "BASE=${BASE} has no @sha256: digest; pass --build-arg BASE=IMAGE:TAG@sha256:DIGEST (docs/docker.md)" >&2; \
               exit 1; \
           fi ;; \
    esac

# tini as PID 1 forwards docker stop's SIGTERM to vLLM and reaps its exited worker processes.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*

# Must name the vLLM that BASE carries; the build checks it against the installed vLLM.
ARG VLLM_VERSION=0.33.0
# Optional: when set, the build fails unless the install's digest equals it (docs/docker.md).
ARG PIN_DIGEST=""

# JIT caches live under one volume so a recreated container reuses them instead of recompiling.
ENV VLLM_CACHE_ROOT=/var/cache/dspark/vllm \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/dspark/inductor \
    TRITON_CACHE_DIR=/var/cache/dspark/triton \
    FLASHINFER_WORKSPACE_BASE=/var/cache/dspark/flashinfer \
    CUTE_DSL_CACHE_DIR=/var/cache/dspark/cute-dsl \
    TILELANG_CACHE_DIR=/var/cache/dspark/tilelang \
    TVM_FFI_CACHE_DIR=/var/cache/dspark/tvm-ffi \
    DG_JIT_CACHE_DIR=/var/cache/dspark/deep-gemm \
    CUDA_CACHE_PATH=/var/cache/dspark/cuda \
    CUDA_CACHE_MAXSIZE=4294967296

# Serving defaults shared by the entrypoint and the health check. A first JIT compile can outlast
# vLLM's default 300 s step timeout, which would kill the tensor-parallel pair.
ENV DSPARK_HOST=0.0.0.0 \
    DSPARK_PORT=8000 \
    DSPARK_RUN_DIR=/run/dspark \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=1800

# Only what the install reads comes before it, so that editing a profile, the entrypoint or the
# health check rebuilds in seconds instead of re-running the install.
WORKDIR /opt/dspark
COPY install.py ./
COPY installer/ installer/
COPY dspark_common/ dspark_common/
COPY recipe/pins.yaml recipe/
COPY overlay/ overlay/
COPY patches/ patches/
COPY docker/install-and-verify.sh docker/verify_install.py docker/

# Patch the image's vLLM and prove it: the image refuses to build unless the install is complete,
# matches VLLM_VERSION (and PIN_DIGEST if given) and every DSpark module imports. Every cache
# directory, including those the verify step's imports just created as root, is made writable
# for vLLM's non-root mode (--user UID:0), recursively.
RUN EXPECT_VLLM_VERSION="${VLLM_VERSION}" EXPECT_PIN_DIGEST="${PIN_DIGEST}" \
        docker/install-and-verify.sh python3 \
    && mkdir -p /run/dspark "${VLLM_CACHE_ROOT}" "${TORCHINDUCTOR_CACHE_DIR}" "${TRITON_CACHE_DIR}" \
        "${FLASHINFER_WORKSPACE_BASE}" "${CUTE_DSL_CACHE_DIR}" "${TILELANG_CACHE_DIR}" \
        "${TVM_FFI_CACHE_DIR}" "${DG_JIT_CACHE_DIR}" "${CUDA_CACHE_PATH}" \
    && chmod -R g=u /var/cache/dspark /run/dspark

COPY docker/entrypoint.sh docker/healthcheck.py docker/
# The GPU self-test (python3 -m tools.gpu_selftest, run by dspark-launch preflight) and the tiny
# checkpoint builders and engine harness its engine checks use.
COPY dspark_fixtures/ dspark_fixtures/

# Torch extensions and FlashInfer JIT-compile for B200 (sm_100a), B300 (sm_103a) and RTX PRO 6000
# (sm_120a): "a" code runs only on exactly its architecture, so each needs its own entry. CuTe
# DSL takes a single target: sm_100a (B200 class); build with --build-arg CUTE_DSL_ARCH=sm_103a
# or sm_120a for those hosts (or pass -e CUTE_DSL_ARCH=... at run time).
ARG CUTE_DSL_ARCH=sm_100a
ENV TORCH_CUDA_ARCH_LIST="10.0a 10.3a 12.0a" \
    FLASHINFER_CUDA_ARCH_LIST="10.0a 10.3a 12.0a" \
    CUTE_DSL_ARCH="${CUTE_DSL_ARCH}"

# Prove the GPU code before the image is tagged: the JIT arch lists above cover every target,
# and torch, vLLM's core and MoE extensions (found by role in its RECORD) and FlashInfer carry
# machine code or PTX for each (else the build fails naming the binary). ARCH_LISTING_JSON
# stands in for vLLM's RECORD and the binaries' listing; only the CPU stand-in test sets it (its
# base carries vLLM's CPU build). docs/docker.md.
ARG GPU_TARGETS="sm_100 sm_103 sm_120"
ARG ARCH_LISTING_JSON=""
COPY tools/ tools/
RUN python3 docker/verify_install.py --architectures "${GPU_TARGETS}" \
        --listing-json "${ARCH_LISTING_JSON}"

# Project identity, recorded in the labels: pass $(git rev-parse HEAD) and the repository URL.
# Declared last: a new revision must not invalidate the install layer above.
ARG DSPARK_REVISION
ARG DSPARK_SOURCE=""
LABEL org.opencontainers.image.title="dspark-vllm for Blackwell (x86_64)" \
      org.opencontainers.image.source="${DSPARK_SOURCE}" \
      org.opencontainers.image.revision="${DSPARK_REVISION:?required-build-arg-see-docs/docker.md}" \
      org.opencontainers.image.base.name="${BASE}" \
      io.github.dspark-vllm.vllm.version="${VLLM_VERSION}" \
      io.github.dspark-vllm.pin.digest="${PIN_DIGEST}"

VOLUME ["/var/cache/dspark"]
EXPOSE 8000
# vLLM can take tens of minutes to load DeepSeek-V4-Flash and warm up its kernels.
HEALTHCHECK --interval=30s --timeout=10s --start-period=40m --retries=3 \
    CMD ["python3", "/opt/dspark/docker/healthcheck.py"]
ENTRYPOINT ["/usr/bin/tini", "--", "/opt/dspark/docker/entrypoint.sh"]
