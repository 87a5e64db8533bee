#!/usr/bin/env bash
# Container entrypoint: `vllm serve` with the image's defaults, then the user's own arguments.
#
# The user's arguments are passed on unchanged. `exec` replaces this shell with vLLM, so
# `docker stop` (SIGTERM) and Ctrl-C (SIGINT) reach vLLM itself. The bind address comes from
# DSPARK_HOST/DSPARK_PORT (set in the Dockerfile, overridable with -e), not from --host/--port,
# because the health check reads the same variables to probe the address vLLM binds.
set -euo pipefail

usage_error() {
    printf 'dspark entrypoint: %s\n' "$1" >&2
    exit 2
}

host=${DSPARK_HOST:?DSPARK_HOST is unset: the image sets it; pass -e DSPARK_HOST=ADDRESS}
port=${DSPARK_PORT:?DSPARK_PORT is unset: the image sets it; pass -e DSPARK_PORT=PORT}
run_dir=${DSPARK_RUN_DIR:?DSPARK_RUN_DIR is unset: the image sets it}

if [[ ! $port =~ ^[0-9]{1,5}$ ]] || ((10#$port < 1 || 10#$port > 65535)); then
    usage_error "DSPARK_PORT='$port' is not a TCP port (1-65535)"
fi
if (($# == 0)); then
    usage_error "no arguments: pass the model and any 'vllm serve' options, for example
    docker run ... IMAGE deepseek-ai/DeepSeek-V4-Flash-0731 --tensor-parallel-size 2"
fi

# vLLM's parser accepts unambiguous abbreviations (--por 9000 sets the port), so match prefixes.
headless=false
for arg in "$@"; do
    option=${arg%%=*}
    ((${#option} >= 3)) || continue
    if [[ --host == "$option"* || --port == "$option"* ]]; then
        usage_error "'$arg': set the bind address with -e DSPARK_HOST=... and -e DSPARK_PORT=... instead,
    so that the health check probes the address vLLM listens on"
    fi
    if [[ --headless == "$option"* ]]; then
        headless=true
    fi
done

# A headless worker starts no API server: the health check reads this marker instead of /health.
mkdir -p "$run_dir"
if $headless; then
    : >"$run_dir/headless"
else
    rm -f "$run_dir/headless"
fi

exec vllm serve --host "$host" --port "$((10#$port))" "$@"
