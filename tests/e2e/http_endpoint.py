"""A real HTTP(S) server on a free loopback port for the services' HTTP clients to talk to (a JWKS endpoint, an
authentication service): `HttpEndpoint(answer)` calls `answer(request)` in its own thread for every request and
sends what it returns; every request is kept in `requests`. With `tls=(cert, key)` it serves https."""

from __future__ import annotations

import http.server
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Request:
    """One request as the server read it; `headers` by lower-case name."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


class HttpEndpoint:
    def __init__(self, answer: Callable[[Request], Answer], tls: tuple[Path, Path] | None = None) -> None:
        self.requests: list[Request] = []
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                headers = {k.lower(): v for k, v in self.headers.items()}
                request = Request(self.command, self.path, headers, self.rfile.read(length))
                endpoint.requests.append(request)
                got = answer(request)
                self.send_response(got.status)
                for name, value in got.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(got.body)))
                self.end_headers()
                self.wfile.write(got.body)

            do_GET = do_POST = _serve  # noqa: N815 (http.server's names)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        scheme = "http"
        if tls is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(*map(str, tls))
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.base = f"{scheme}://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
