"""HTTP servers on 127.0.0.1 that a test stands up as a peer of the service (an API
provider, a scheduler of an earlier release): the JSON answer and the server's life."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class JsonHandler(BaseHTTPRequestHandler):
    """A request handler that answers in JSON and logs nothing."""

    def answer(self, status: int, body: Any) -> None:
        """``body`` as JSON, or as it is when it is bytes already."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        with contextlib.suppress(ConnectionError):  # (a peer need not read it to its end)
            self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    # A listen backlog for a burst of connections at once (socketserver's is 5): one over
    # it is dropped and tried again by the client after 1, 3, 7, ... s.
    request_queue_size = 256


@contextlib.contextmanager
def http_serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """``handler`` served on 127.0.0.1 while the block runs: its base URL."""
    server = _Server(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
