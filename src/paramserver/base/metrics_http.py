"""The HTTP server behind a node's metrics endpoint: prometheus_client's WSGI app, served by a fixed
pool of threads instead of a thread per connection (prometheus_client's own server), so that idle or
slow connections cost a bounded number of threads and descriptors (docs/operations.md).

Only /metrics answers (other paths: 404). At most HELD connections are held at once (served, or
waiting for a thread); a further one is closed at once, unanswered. A connection that sends no
complete request within REQUEST_TIMEOUT_S of its accept is closed. A scraper that meets a full server
scrapes again at its next interval.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger(__name__)
THREADS = 4  # requests served at once: a scrape takes milliseconds
HELD = 16  # connections held at once, served or waiting
REQUEST_TIMEOUT_S = 5.0  # from accept to a whole request read
_LEAST_TIMEOUT_S = 0.5  # a connection that waited that long for a thread still gets this to be read


class _Handler(WSGIRequestHandler):
    timeout = None  # PooledWSGIServer sets the connection's timeout: what is left of its deadline

    def log_message(self, format: str, *args) -> None:
        """Scrapes are not logged: one every few seconds, forever."""


class PooledWSGIServer(WSGIServer):
    """A WSGI server whose requests run on `threads` threads ("metrics-http-request_N")."""

    request_queue_size = 64  # the listen backlog: connections beyond HELD are accepted and closed at once

    def __init__(self, address: tuple, threads: int = THREADS, held: int = HELD) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="metrics-http-request")
        self._held = threading.BoundedSemaphore(held)
        super().__init__(address, _Handler)

    def process_request(self, request, client_address) -> None:
        if not self._held.acquire(blocking=False):
            log.debug("metrics endpoint: %d connections held already; closed one from %s", HELD, client_address)
            self.shutdown_request(request)
            return
        # the deadline runs from the accept: a connection waiting for a thread spends its time too
        self._pool.submit(self._serve, request, client_address, time.monotonic() + REQUEST_TIMEOUT_S)

    def _serve(self, request, client_address, deadline: float) -> None:
        try:
            request.settimeout(max(_LEAST_TIMEOUT_S, deadline - time.monotonic()))
            self.finish_request(request, client_address)
        except OSError as exc:  # TimeoutError: sent no whole request in time; or the peer went away
            log.debug("metrics endpoint: connection from %s closed: %s", client_address, exc)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._held.release()

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _only_metrics(app):
    """`app` at /metrics; every other path is 404 (prometheus_client's app answers any path)."""

    def serve(environ, start_response):
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"only /metrics is served here\n"]
        return app(environ, start_response)

    return serve


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> tuple[PooledWSGIServer, threading.Thread]:
    """Serve `registry` at http://host:port/metrics; the server and its thread ("metrics-http").
    Raises OSError when the address cannot be bound."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server_class = type("MetricsServer", (PooledWSGIServer,), {"address_family": family})
    server = server_class((sockaddr[0], port))
    server.set_app(_only_metrics(make_wsgi_app(registry)))
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return server, thread
