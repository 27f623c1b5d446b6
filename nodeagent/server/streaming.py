"""exec, attach and portForward: the client's upgraded connection proxied, byte for
byte, to the URL the runtime's streaming server gave (CRI Exec, Attach, PortForward).

The runtime speaks the protocols (SPDY/3.1 and the channel.k8s.io WebSockets that
kubectl and the API server use), so the agent only moves bytes: it sends the request
on to the runtime, and once the runtime answers 101 Switching Protocols it hands the
client's socket and the runtime's to a pair of pipes. Each pipe pauses reading from
one side while the other side's send buffer is full, so a slow reader holds back its
writer and nothing piles up in the agent. A pair that carries no byte either way for
the streaming connection idle timeout is closed (the kubelet's
streamingConnectionIdleTimeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.parse
from typing import Any

from aiohttp import web

from nodeagent.api.clock import Clock

log = logging.getLogger(__name__)

HEAD_LIMIT = 64 * 1024
# not sent on: the runtime needs none of the client's credentials, and the host is its own
_DROP = {"host", "authorization", "content-length", "transfer-encoding", "x-remote-user",
         "x-remote-group"}


def is_upgrade(request: web.Request) -> bool:
    tokens = {t.strip().lower() for t in request.headers.get("Connection", "").split(",")}
    return "upgrade" in tokens and bool(request.headers.get("Upgrade"))


class _Pipe(asyncio.Protocol):
    """One socket's protocol: what arrives goes to the peer socket."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.peer: Any = None
        self.early = bytearray()  # what arrived before the peer was connected
        self.received = 0  # bytes so far: the idle check looks for a change
        self.head = asyncio.get_running_loop().create_future()  # backend: its response head
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        if self.peer is not None:
            self.peer.write(data)
            return
        self.early += data
        if not self.head.done():
            end = self.early.find(b"\r\n\r\n")
            if end >= 0:
                self.head.set_result(end + 4)
            elif len(self.early) > HEAD_LIMIT:
                self.head.set_exception(ValueError("response head too long"))
                self.transport.close()

    def connect(self, peer: Any) -> None:
        self.peer = peer
        if self.early:
            peer.write(bytes(self.early))
            self.early.clear()

    def eof_received(self) -> bool:
        if self.peer is not None and self.peer.can_write_eof():
            self.peer.write_eof()
            return True  # the other direction may still carry data
        if self.peer is not None:
            self.peer.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.head.done():
            self.head.set_exception(ConnectionError("the runtime closed the connection"))
        if self.peer is not None:
            self.peer.close()
        if not self.closed.done():
            self.closed.set_result(None)

    # our socket's send buffer is full: stop reading what fills it
    def pause_writing(self) -> None:
        if self.peer is not None:
            self.peer.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None:
            self.peer.resume_reading()


async def proxy(request: web.Request, url: str, clock: Clock,
                idle_timeout: float) -> web.StreamResponse:
    """Proxy the upgrade request to `url`; returns once both sides are closed."""
    if not is_upgrade(request):
        return web.Response(status=400, text="Upgrade request required\n")
    target = urllib.parse.urlsplit(url)
    if target.scheme != "http" or not target.hostname:
        return web.Response(status=500, text=f"runtime streaming URL {url!r} is not "
                                             "plain http\n")
    port = target.port or 80
    loop = asyncio.get_running_loop()
    try:
        backend_transport, backend = await loop.create_connection(
            _Pipe, target.hostname, port)
    except OSError as e:
        return web.Response(status=502, text=f"cannot reach the runtime's streaming server "
                                             f"{target.hostname}:{port}: {e.strerror or e}\n")
    path = target.path + (f"?{target.query}" if target.query else "")
    lines = [f"{request.method} {path or '/'} HTTP/1.1", f"Host: {target.netloc}"]
    lines += [f"{k}: {v}" for k, v in request.headers.items() if k.lower() not in _DROP]
    backend_transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    try:
        end = await asyncio.wait_for(backend.head, 30)
    except (TimeoutError, ValueError, ConnectionError) as e:
        backend_transport.close()
        return web.Response(status=502, text=f"the runtime's streaming server did not "
                                             f"answer: {e}\n")
    head = bytes(backend.early[:end])
    del backend.early[:end]
    status_line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = status_line.split(" ", 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 502
    if status != 101:
        return await _relay_refusal(backend_transport, backend, status, head)
    client = request.transport
    if client is None or client.is_closing():
        backend_transport.close()
        return web.Response(status=499)
    # From here the client's socket is ours: the runtime's 101 goes out as it came,
    # and neither side's bytes pass through aiohttp any more.
    client_pipe = _Pipe()
    aiohttp_protocol = client.get_protocol()
    client.set_protocol(client_pipe)
    client_pipe.connection_made(client)
    client.write(head)
    client_pipe.connect(backend_transport)
    backend.connect(client)
    with contextlib.suppress(Exception):
        client.resume_reading()
    idle = asyncio.create_task(_close_when_idle(clock, idle_timeout, client_pipe, backend))
    try:
        await asyncio.gather(client_pipe.closed, backend.closed)
    finally:
        idle.cancel()
        # aiohttp no longer sees this socket: tell it the connection is gone, or it
        # counts (and holds) the connection for ever
        aiohttp_protocol.connection_lost(None)
    # aiohttp's response for this request can no longer be sent; closing says so
    resp = web.Response(status=101)
    resp.force_close()
    return resp


async def _close_when_idle(clock: Clock, timeout: float, *pipes: _Pipe) -> None:
    """Close both sides once no byte has passed either way for `timeout` seconds
    (checked every quarter of it)."""
    seen, since = -1, clock.monotonic()
    while True:
        moved = sum(p.received for p in pipes)
        if moved != seen:
            seen, since = moved, clock.monotonic()
        elif clock.monotonic() - since >= timeout:
            log.info("kubelet API: closing a stream idle for %.0f s", timeout)
            for p in pipes:
                if p.transport is not None:
                    p.transport.close()
            return
        await clock.sleep(timeout / 4)


async def _relay_refusal(transport: Any, backend: _Pipe, status: int,
                         head: bytes) -> web.Response:
    """The runtime refused the stream (a bad token, a finished container): its answer,
    with at most 64 KiB of its body, goes back to the client."""
    ctype, length = "text/plain", HEAD_LIMIT
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.decode("latin-1").partition(":")
        if k.strip().lower() == "content-type":
            ctype = v.strip()
        elif k.strip().lower() == "content-length" and v.strip().isdigit():
            length = min(int(v.strip()), HEAD_LIMIT)
    deadline = asyncio.get_running_loop().time() + 5
    while len(backend.early) < length and not backend.closed.done():
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(backend.closed), min(left, 0.05))
    transport.close()
    body = bytes(backend.early[:length])
    return web.Response(status=status, body=body, content_type=ctype.split(";")[0])
