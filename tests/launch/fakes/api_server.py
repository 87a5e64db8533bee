# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Stand-in for the head container's OpenAI API, started by the fake docker: answers /health,
/v1/models and one-token completions, and appends each request's Authorization header to a file.
Usage: api_server.py PORT AUTH_LOG"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def _answer(self, body: dict) -> None:
        with open(sys.argv[2], "a") as log:
            log.write(f"{self.command} {self.path} {self.headers.get('Authorization')}\n")
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer({"object": "list", "data": []})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._answer({"choices": [{"text": " hi"}], "usage": {"completion_tokens": 1}})

    def log_message(self, *args) -> None:
        pass


ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
