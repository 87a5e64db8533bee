#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
# Container entrypoint: `vllm serve` with the user's arguments, then the image's bind address.
#
# The user's arguments come first and unchanged: vLLM wants the model as the first argument after
# `serve`, and refuses to start otherwise when --served-model-name is given (the launcher always
# passes it). The bind address is appended from DSPARK_HOST/DSPARK_PORT (set in the Dockerfile,
# overridable with -e), never taken from --host/--port or a --config file, because the health
# check reads the same variables to probe the address vLLM binds. `exec` makes vLLM the direct
# child of tini, the image's PID 1, which forwards `docker stop`'s SIGTERM and Ctrl-C's SIGINT.
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
# An IPv4 address or host name, or an IPv6 address: anything else is not a bind address, and
# would reach vLLM's command line (a leading '-' as an option).
if [[ ! $host =~ ^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$ && ! $host =~ ^[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*$ ]]; then
    usage_error "DSPARK_HOST='$host' is not an IP address or host name; pass -e DSPARK_HOST=ADDRESS"
fi
if (($# == 0)); then
    usage_error "no arguments: pass the model and any 'vllm serve' options, for example
    docker run ... IMAGE deepseek-ai/DeepSeek-V4-Flash-0731 --tensor-parallel-size 2"
fi

# vLLM's parser accepts unambiguous abbreviations (--por 9000 sets the port), so match prefixes.
refuse_bind_option() {
    local option=$1 source=$2
    ((${#option} >= 3)) || return 0
    if [[ --host == "$option"* || --port == "$option"* ]]; then
        usage_error "$source: set the bind address with -e DSPARK_HOST=... and -e DSPARK_PORT=...
    instead, so that the health check probes the address vLLM listens on"
    fi
}

# The top-level keys of a `--config` YAML file: vLLM turns each KEY into an option --KEY. Read with
# the bounded YAML reader (dspark_common/safe_yaml.py, in the directory above this script's).
project_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
config_keys() {
    python3 - "$project_dir" "$1" <<'PYTHON'
import sys
from pathlib import Path

sys.path.insert(0, sys.argv[1])
from dspark_common.operator_input import cut
from dspark_common.safe_yaml import YamlError, load_mapping

try:
    config = load_mapping(Path(sys.argv[2]))
except YamlError as error:
    sys.exit(f"dspark entrypoint: --config {error}")
print("\n".join(cut(str(key)) for key in config))
PYTHON
}

headless=false
config=""
previous=""
for arg in "$@"; do
    option=${arg%%=*}
    refuse_bind_option "$option" "'$arg'"
    if [[ --headless == "$option"* && ${#option} -ge 3 ]]; then
        headless=true
    fi
    if [[ $previous == --config ]]; then
        config=$arg
    elif [[ $option == --config && $arg == --config=* ]]; then
        config=${arg#--config=}
    fi
    if [[ -n $config ]]; then
        keys=$(config_keys "$config") || exit 2
        while IFS= read -r key; do
            if [[ -n $key ]]; then
                refuse_bind_option "--$key" "--config $config sets '$key'"
            fi
        done <<<"$keys"
        config=""
    fi
    previous=$arg
done

# A headless worker starts no API server: the health check reads this marker instead of /health.
mkdir -p "$run_dir"
if $headless; then
    : >"$run_dir/headless"
else
    rm -f "$run_dir/headless"
fi

exec vllm serve "$@" --host "$host" --port "$((10#$port))"
