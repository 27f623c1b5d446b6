"""The metrics and health HTTP endpoint both programs expose."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

# A check returns None when healthy, or a sentence saying what is wrong.
HealthCheck = Callable[[], str | None]


class _ThreadingHTTPServer6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def tasks_metric(loop: asyncio.AbstractEventLoop | None) -> bytes:
    """nodepulse_asyncio_tasks: the event loop's tasks not yet done, read when scraped
    (a count that only grows is a leak of tasks)."""
    if loop is None or loop.is_closed():
        return b""
    count = len(asyncio.all_tasks(loop))  # safe from another thread: it copies first
    return (b"# HELP nodepulse_asyncio_tasks Tasks of the event loop not yet done\n"
            b"# TYPE nodepulse_asyncio_tasks gauge\n"
            b"nodepulse_asyncio_tasks %d\n" % count)


class HealthServer:
    """Serves /metrics, /healthz (every check passes) and /readyz (same, plus readiness).
    Made inside a running event loop, /metrics also counts that loop's tasks."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None
        self.health_checks: dict[str, HealthCheck] = {}
        self.ready_checks: dict[str, HealthCheck] = {}
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(owner.registry) + tasks_metric(owner.loop),
                               CONTENT_TYPE_LATEST)
                elif path in ("/healthz", "/livez"):
                    self._checks(owner.health_checks)
                elif path == "/readyz":
                    self._checks({**owner.health_checks, **owner.ready_checks})
                else:
                    self._send(404, b"not found\n")

            def _checks(self, checks: dict[str, HealthCheck]) -> None:
                failures = [f"{name}: {msg}" for name, check in checks.items()
                            if (msg := check()) is not None]
                if failures:
                    self._send(500, ("\n".join(failures) + "\n").encode())
                else:
                    self._send(200, b"ok\n")

            def _send(self, code: int, body: bytes, ctype: str = "text/plain") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # scrapes every few seconds would drown the real log

        # an IPv6 literal needs its own address family: http.server binds IPv4
        server_class = _ThreadingHTTPServer6 if ":" in host else ThreadingHTTPServer
        self._server = server_class((host, port), Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="health-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread:
            self._thread.join()
