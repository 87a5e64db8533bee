# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Docker HEALTHCHECK for the DSpark images: probe vLLM's /health where the entrypoint binds it.

The address comes from DSPARK_HOST/DSPARK_PORT, the same variables the entrypoint passes to
`vllm serve`, so the probe cannot drift from the bind address. A headless worker (marker file
written by the entrypoint) serves no HTTP and counts as healthy while its container runs.
Exit status follows Docker's contract: 0 healthy, 1 unhealthy.
"""

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

# Wildcard bind addresses are reachable through loopback.
_LOOPBACK_FOR = {"0.0.0.0": "127.0.0.1", "::": "::1"}


def health_url(env: Mapping[str, str]) -> str:
    """URL of vLLM's /health endpoint for the bind address in `env`."""
    host = _LOOPBACK_FOR.get(env["DSPARK_HOST"], env["DSPARK_HOST"])
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{int(env['DSPARK_PORT'])}/health"


def probe(url: str, timeout_s: float) -> str | None:
    """Return None when `url` answers 200, else the reason it is unhealthy."""
    # Bypass any HTTP(S)_PROXY in the container's environment: the target is always local.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as error:
        return f"HTTP {error.code}"
    except (urllib.error.URLError, OSError) as error:
        return str(getattr(error, "reason", error))


def main() -> int:
    if (Path(os.environ["DSPARK_RUN_DIR"]) / "headless").exists():
        return 0
    url = health_url(os.environ)
    # Shorter than the Dockerfile's HEALTHCHECK --timeout, so a hung server reports a reason.
    reason = probe(url, timeout_s=5.0)
    if reason is None:
        return 0
    print(f"unhealthy: {url}: {reason}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
