"""The HTTP transport under nodeagent.api.kube: the only module that speaks HTTP.

`Transport` is what the agent and the operator use: requests on the event loop itself
(aiohttp, keep-alive connections, at most `connections` at once), with the Credentials
nodeagent.api.client loads (server, CA, client certificate, the Authorization header and
its refresh). No thread per request: handing each request to a thread and its answer
back to the loop cost more CPU than the request itself, which counts when one process
renews the Leases of thousands of nodes. A watch is read on the loop too, a chunk at a
time.

Bodies are plain dicts in the API's JSON form, in and out (cheap to hash and compare,
nothing dropped). Non-2xx answers raise ApiError (with status, reason, body and
headers); a transport failure raises ConnectionError or TimeoutError.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import aiohttp
from multidict import CIMultiDict

from nodeagent.api.client import USER_AGENT, ApiError, Credentials

Timeout = float | tuple[float, float] | None  # None: no timeout; (connect, read)
# The Accept of a request whose answer is not parsed: the object's metadata only, so the
# API server encodes and we read less (a one-container pod's status PATCH answered with
# 1398 bytes instead of 2307); plain JSON from a server that cannot.
METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"


def _q(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


class JsonLines:
    """A watch stream (one JSON object per line) cut into the objects of each chunk: a
    batch is complete as soon as the chunk's last line is."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[Any]:
        if b"\n" not in chunk:
            self._buf += chunk
            return []
        *lines, self._buf = (self._buf + chunk).split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def end(self) -> list[Any]:
        rest, self._buf = self._buf, b""
        return [json.loads(rest)] if rest.strip() else []


def json_lines(chunks: Iterator[bytes]) -> Iterator[list[Any]]:
    """JsonLines over an iterator of chunks: the non-empty batches."""
    lines = JsonLines()
    for chunk in chunks:
        if objs := lines.feed(chunk):
            yield objs
    if objs := lines.end():
        yield objs


def api_error(resp: aiohttp.ClientResponse, data: bytes) -> ApiError:
    return ApiError(resp.status, resp.reason or "", data, CIMultiDict(resp.headers))


def client_timeout(timeout: Timeout) -> aiohttp.ClientTimeout:
    """A number bounds the whole request; (connect, read) bounds connecting and each
    read (a watch waits long between events, but not forever)."""
    if timeout is None:
        return aiohttp.ClientTimeout(total=None)
    if isinstance(timeout, tuple):
        return aiohttp.ClientTimeout(total=None, sock_connect=timeout[0], sock_read=timeout[1])
    return aiohttp.ClientTimeout(total=timeout)


class Connections:
    """The keep-alive connections to one API server that a Transport and those it
    `separate`s share (one aiohttp session, made in the loop that first uses it, and
    no limit of its own: the Transports' turns bound the requests). Shared, because a
    TLS handshake costs both ends milliseconds of CPU: a burst of pod status writes
    takes the connections the Lease renewals left idle instead of opening its own
    (at the first burst of a Deployment, sixteen handshakes where every write then
    waited 0.1 s for its answer)."""

    # idle connections are kept this long: under the API server's 90 s idle timeout,
    # so it is never the server that closes one as it is being reused
    KEEPALIVE_S = 60.0
    # connections made with a replaced client certificate are closed this long after
    RETIRE_S = 60.0

    def __init__(self, creds: Credentials) -> None:
        self.creds = creds
        self._ssl: ssl.SSLContext | None = None  # made with the first session
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.opened = 0  # connections opened (keep-alive works when this stays small)
        self._generation = creds.generation  # of the client certificate the session uses
        self._retiring: set[aiohttp.ClientSession] = set()

    def session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is not None and self._generation != self.creds.generation \
                and self._loop is loop and not self._session.closed:
            self._retire(self._session, loop)
            self._session = None
        if self._session is None or self._loop is not loop or self._session.closed:
            self._generation = self.creds.generation
            if self._ssl is None:
                self._ssl = self.creds.ssl_context()
            # counted where their sockets are made: a TraceConfig would cost every
            # request a dozen signal calls (about 25 us of the ~110 aiohttp takes)
            connector = aiohttp.TCPConnector(limit=0, ssl=self._ssl or False,
                                             keepalive_timeout=self.KEEPALIVE_S,
                                             enable_cleanup_closed=True,
                                             socket_factory=self._new_socket)
            self._session = aiohttp.ClientSession(connector=connector,
                                                  skip_auto_headers=("User-Agent",))
            self._loop = loop
        return self._session

    def _retire(self, old: aiohttp.ClientSession, loop: asyncio.AbstractEventLoop) -> None:
        """The client certificate was replaced: new requests go over new connections,
        and those made with the old certificate are closed once the requests on them had
        time to finish (the API server checks a certificate's expiry on every request,
        not only when a connection is made). A watch on one is cut then, and resumes."""
        self._retiring.add(old)

        def close() -> None:
            self._retiring.discard(old)
            loop.create_task(old.close())
        loop.call_later(self.RETIRE_S, close)

    def _new_socket(self, addr: tuple[Any, ...]) -> socket.socket:
        self.opened += 1
        family, type_, proto, _, _ = addr
        return socket.socket(family=family, type=type_, proto=proto)

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed \
                and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None
        for old in list(self._retiring):
            await old.close()
        self._retiring.clear()


class Transport:
    """Requests to one API server on the running event loop, over keep-alive connections:
    at most `connections` requests at once, more wait their turn, and a request's
    timeout runs from its turn (as when each request had a thread of a pool), so a
    burst (a thousand nodes registering) is slow, never failed by its queue. Watches
    take no turn: each holds a connection for as long as it runs. `separate` gives
    another Transport to the same server with turns of its own, for callers that must
    never wait behind others (a Lease renewal behind a burst of status writes); the
    connections themselves are one pool (Connections), which opens another whenever
    none is idle."""

    def __init__(self, creds: Credentials, connections: int = 16,
                 component: str = "nodepulse") -> None:
        self.creds = creds
        self.base = creds.server
        self.connections = connections
        self._headers = {"Accept": "application/json",
                         "User-Agent": f"{USER_AGENT}/{component}"}
        self.pool = Connections(creds)
        self._turns: asyncio.Semaphore | None = None  # `connections` requests at once
        self._turns_loop: asyncio.AbstractEventLoop | None = None

    def separate(self, connections: int) -> Transport:
        other = Transport.__new__(Transport)
        other.__dict__.update(self.__dict__)
        other.connections, other._turns, other._turns_loop = connections, None, None
        return other

    @property
    def opened(self) -> int:
        """Connections opened by the pool this Transport shares."""
        return self.pool.opened

    def _turns_here(self) -> asyncio.Semaphore:
        """The turns of the running loop (a Semaphore is bound to the loop it waits in)."""
        loop = asyncio.get_running_loop()
        if self._turns is None or self._turns_loop is not loop:
            self._turns, self._turns_loop = asyncio.Semaphore(self.connections), loop
        return self._turns

    def _request_headers(self, content_type: str | None, parse: bool) -> dict[str, str]:
        headers = dict(self._headers)
        if not parse:
            headers["Accept"] = METADATA_ONLY
        auth = self.creds.authorization()
        if auth:
            headers["Authorization"] = auth
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def _send(self, method: str, path: str, query: dict[str, Any] | None, body: Any,
              timeout: Timeout, content_type: str, parse: bool = True) -> Any:
        """The request context manager; the caller enters it."""
        params = [(k, _q(v)) for k, v in (query or {}).items() if v is not None]
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        return self.pool.session().request(
            method, self.base + path, params=params or None, data=data,
            headers=self._request_headers(content_type if data is not None else None, parse),
            timeout=client_timeout(timeout), proxy=self.creds.proxy,
            server_hostname=self.creds.tls_server_name, allow_redirects=False)

    async def request(self, method: str, path: str, *, query: dict[str, Any] | None = None,
                      body: Any = None, timeout: Timeout = 30.0,
                      content_type: str = "application/json", parse: bool = True) -> Any:
        """The answer's JSON (None when `parse` is false: read to its end, unparsed).
        Raises ApiError for a non-2xx status."""
        async with self._turns_here():
            try:
                async with self._send(method, path, query, body, timeout, content_type,
                                      parse) as resp:
                    data = await resp.read()
                    if not 200 <= resp.status <= 299:
                        raise api_error(resp, data)
            except aiohttp.ClientError as e:
                raise transport_error(method, path, e) from e
            except TimeoutError as e:  # aiohttp's own says nothing
                raise TimeoutError(f"{method} {path}: no answer within {timeout} s") from e
        return json.loads(data) if parse else None

    async def watch(self, path: str, query: dict[str, Any], timeout: Timeout) -> Watch:
        """Open a watch: returns once the server took it; raises its refusal."""
        ctx = self._send("GET", path, query, None, timeout, "")
        try:
            resp = await ctx.__aenter__()
            if not 200 <= resp.status <= 299:
                data = await resp.read()
                resp.release()
                raise api_error(resp, data)
        except aiohttp.ClientError as e:
            raise transport_error("GET", path, e) from e
        return Watch(resp, asyncio.get_running_loop(), path)

    async def aclose(self) -> None:
        """Close the connections this Transport shares with those `separate` made."""
        await self.pool.aclose()


def transport_error(method: str, path: str, e: aiohttp.ClientError) -> Exception:
    """aiohttp's failures as the standard library's (is_retriable knows those)."""
    if isinstance(e, aiohttp.ServerTimeoutError):
        return TimeoutError(f"{method} {path}: {e}")
    return ConnectionError(f"{method} {path}: {type(e).__name__}: {e}")


class Watch:
    """An open watch: iterating yields the events of each chunk as it completes, and
    ends when the server ends the watch. `close()` may be called from any thread."""

    def __init__(self, resp: aiohttp.ClientResponse, loop: asyncio.AbstractEventLoop,
                 path: str) -> None:
        self._resp, self._loop, self._path = resp, loop, path
        self._lines = JsonLines()
        self._ended = False

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> list[dict[str, Any]]:
        while not self._ended:
            try:
                chunk = await self._resp.content.readany()
            except aiohttp.ClientError as e:
                self._ended = True
                raise transport_error("GET", self._path, e) from e
            except TimeoutError as e:
                self._ended = True
                raise TimeoutError(f"watch {self._path}: no data within the read timeout") from e
            if not chunk:
                self._ended = True
                if objs := self._lines.end():
                    return objs
                break
            if objs := self._lines.feed(chunk):
                return objs
        self._resp.release()
        raise StopAsyncIteration

    def close(self) -> None:
        """Shut the connection (a read in progress fails as a network failure would)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._resp.close()
        else:
            with contextlib.suppress(RuntimeError):  # a closed loop: a closed connection
                self._loop.call_soon_threadsafe(self._resp.close)

    async def aclose(self) -> None:
        self._ended = True
        self._resp.close()
