# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""HTTP checks against the head's OpenAI-compatible API (no proxies: the target is ours)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ApiClient:
    def __init__(self, host: str, port: int, api_key: str | None) -> None:
        self.base = f"http://{host}:{port}"
        self._api_key = api_key

    def _request(self, path: str, body: dict | None, timeout_s: float) -> tuple[int, str]:
        """(HTTP status, body); status 0 with the reason when nothing answered."""
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base + path, data=data, headers=headers)
        try:
            with _OPENER.open(request, timeout=timeout_s) as response:
                return response.status, response.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except (urllib.error.URLError, OSError) as e:
            return 0, str(getattr(e, "reason", e))

    def not_ready_reason(self) -> str | None:
        """None once /health and /v1/models both answer 200."""
        for path in ("/health", "/v1/models"):
            status, body = self._request(path, None, timeout_s=5)
            if status != 200:
                return f"{path}: " + (f"HTTP {status}" if status else body)
        return None

    def one_token_completion(self, model: str) -> str:
        """Generate one token; returns its text, raises RuntimeError with the reason."""
        body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        status, text = self._request("/v1/completions", body, timeout_s=600)
        if status != 200:
            raise RuntimeError(f"HTTP {status or 'error'}: {text[:300]}")
        choices = json.loads(text).get("choices") or [{}]
        usage = json.loads(text).get("usage") or {}
        if usage.get("completion_tokens") != 1:
            raise RuntimeError(f"expected 1 completion token, got {usage}")
        return choices[0].get("text", "")
