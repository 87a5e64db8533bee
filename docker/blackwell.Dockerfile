# DSpark vLLM image for x86_64 Blackwell servers: B200-class GPUs (compute capability 10.0, sm_100a)
# and RTX PRO 6000 Blackwell-class GPUs (12.0, sm_120a), CUDA 13. Grace-hosted GB200 systems are
# aarch64 and not covered by this file. Build and run: docs/docker.md.
#
# Base: the official vLLM OpenAI server image. Its release tags are multi-arch (linux/amd64 and
# linux/arm64) and, since vLLM 0.20.0, the unsuffixed tag is the CUDA 13.0 build. The vLLM in the
# tag must be a version recipe/pins.yaml supports; install.py refuses any other, so does the build.
#
# Updating the base (the digest pins the bytes; the tag alone is mutable):
#   1. choose a vLLM version listed in recipe/pins.yaml; set BASE_IMAGE's tag and VLLM_VERSION to it;
#   2. docker buildx imagetools inspect vllm/vllm-openai:vX.Y.Z   (the top "Digest:" line);
#   3. pass that digest as --build-arg BASE_DIGEST=sha256:... (or make it the default below, once a
#      maintainer has read it from the registry; none was recorded when this file was written).
ARG BASE_IMAGE=vllm/vllm-openai:v0.33.0
ARG BASE_DIGEST

# The digest may be the multi-arch index's; --platform then selects its linux/amd64 image.
# hadolint ignore=DL3029
FROM --platform=linux/amd64 ${BASE_IMAGE}@${BASE_DIGEST:?required-build-arg-see-docs/docker.md}

ARG BASE_IMAGE
ARG BASE_DIGEST
# Must name the vLLM that BASE_IMAGE carries; the build checks it against the installed vLLM.
ARG VLLM_VERSION=0.33.0
# Project identity, recorded in the labels: pass $(git rev-parse HEAD) and the repository URL.
ARG DSPARK_REVISION
ARG DSPARK_SOURCE=""
# Optional: when set, the build fails unless the install's digest equals it (docs/docker.md).
ARG PIN_DIGEST=""

LABEL org.opencontainers.image.title="dspark-vllm for Blackwell (x86_64)" \
      org.opencontainers.image.source="${DSPARK_SOURCE}" \
      org.opencontainers.image.revision="${DSPARK_REVISION:?required-build-arg-see-docs/docker.md}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      org.opencontainers.image.base.digest="${BASE_DIGEST}" \
      io.github.dspark-vllm.vllm.version="${VLLM_VERSION}" \
      io.github.dspark-vllm.pin.digest="${PIN_DIGEST}"

# Torch extensions and FlashInfer JIT-compile for both Blackwell families. CuTe DSL takes a single
# target: sm_100a (B200 class); build with --build-arg CUTE_DSL_ARCH=sm_120a for RTX PRO 6000 hosts
# (or pass -e CUTE_DSL_ARCH=sm_120a at run time).
ARG CUTE_DSL_ARCH=sm_100a
ENV TORCH_CUDA_ARCH_LIST="10.0a 12.0a" \
    FLASHINFER_CUDA_ARCH_LIST="10.0a 12.0a" \
    CUTE_DSL_ARCH="${CUTE_DSL_ARCH}"

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

WORKDIR /opt/dspark
COPY install.py ./
COPY installer/ installer/
COPY recipe/ recipe/
COPY overlay/ overlay/
COPY patches/ patches/
COPY docker/install-and-verify.sh docker/verify_install.py docker/entrypoint.sh docker/healthcheck.py docker/

# Patch the image's vLLM and prove it: the image refuses to build unless the install is complete,
# matches VLLM_VERSION (and PIN_DIGEST if given) and every DSpark module imports. The cache and
# run directories are group-writable for vLLM's non-root mode (--user 2000:0).
RUN EXPECT_VLLM_VERSION="${VLLM_VERSION}" EXPECT_PIN_DIGEST="${PIN_DIGEST}" \
        docker/install-and-verify.sh python3 \
    && mkdir -p /var/cache/dspark /run/dspark \
    && chmod g+w /var/cache/dspark /run/dspark

VOLUME ["/var/cache/dspark"]
EXPOSE 8000
# vLLM can take tens of minutes to load DeepSeek-V4-Flash and warm up its kernels.
HEALTHCHECK --interval=30s --timeout=10s --start-period=40m --retries=3 \
    CMD ["python3", "/opt/dspark/docker/healthcheck.py"]
ENTRYPOINT ["/opt/dspark/docker/entrypoint.sh"]
