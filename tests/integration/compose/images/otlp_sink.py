"""The compose test's stand-in for the OpenTelemetry collector: OTLP/HTTP on 127.0.0.1:4318 that accepts
what the services export and counts it (`GET /received`: {"/v1/traces": n, ...}); `GET /healthz` for its
health check. Standard library only: it runs in the test's base image."""

from __future__ import annotations

import json
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

received: dict[str, int] = {}
lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with lock:
            received[self.path] = received.get(self.path, 0) + 1
        self._answer(200, b"", "application/x-protobuf")

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._answer(200, b"ok", "text/plain")
        elif self.path == "/received":
            with lock:
                body = json.dumps(received).encode()
            self._answer(200, body, "application/json")
        else:
            self._answer(404, b"", "text/plain")

    def _answer(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # PID 1 of its container: no default action
    ThreadingHTTPServer(("127.0.0.1", 4318), Handler).serve_forever()
