"""The HTTP transport under nodeagent.api.kube: the only module that speaks HTTP.

Requests go through an ApiClient built by nodeagent.api.client (its authentication,
serializer and connection pool), and bodies are plain dicts: the generated methods
turn bodies into models and back, while the agent wants the API's JSON as is (cheap to
hash and compare, nothing dropped, cheaper when one process speaks for many nodes).

The client blocks: RestKube runs each request in a thread, and a watch is read by a
thread of its own (WatchReader) that hands its events to the event loop a chunk at a
time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

Timeout = float | tuple[float, float] | None  # None: no timeout; (connect, read)


def request(api: client.ApiClient, method: str, path: str, *,
            query: dict[str, Any] | None = None, body: Any = None,
            timeout: Timeout = 30.0, content_type: str = "application/json"
            ) -> urllib3.BaseHTTPResponse:
    """Send the request; return the unread urllib3 response (for streaming).
    Raises ApiException for a non-2xx status, like the generated methods."""
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = content_type
    params = [(k, _q(v)) for k, v in (query or {}).items() if v is not None]
    m, url, hdrs, data, post = api.param_serialize(
        method, path, query_params=params, header_params=headers, body=body,
        auth_settings=["BearerToken"])
    resp = api.call_api(m, url, hdrs, data, post, _request_timeout=timeout)
    if not 200 <= resp.status <= 299:
        resp.read()
        raise ApiException.from_response(http_resp=resp, body=None, data=None)
    return resp.response


def request_json(api: client.ApiClient, method: str, path: str, *,
                 query: dict[str, Any] | None = None, body: Any = None,
                 timeout: Timeout = 30.0, content_type: str = "application/json") -> Any:
    resp = request(api, method, path, query=query, body=body, timeout=timeout,
                   content_type=content_type)
    try:
        return json.loads(resp.data)
    finally:
        resp.release_conn()


def request_unread(api: client.ApiClient, method: str, path: str, *,
                   query: dict[str, Any] | None = None, body: Any = None,
                   timeout: Timeout = 30.0, content_type: str = "application/json") -> None:
    """A request whose answer is not needed: the body is read to its end unparsed and
    the connection goes back to the pool. Left unread, the response would hold its
    connection until garbage collection closes it: every such write would open a new
    TLS connection, and the API server would log an aborted request."""
    resp = request(api, method, path, query=query, body=body, timeout=timeout,
                   content_type=content_type)
    try:
        resp.drain_conn()
    finally:
        resp.release_conn()


def _q(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def json_lines(chunks: Iterator[bytes]) -> Iterator[list[Any]]:
    """A watch stream (one JSON object per line) as the objects of each chunk: the
    caller sees each batch as soon as its last line is complete."""
    buf = b""
    for chunk in chunks:
        buf += chunk
        if b"\n" not in chunk:
            continue
        *lines, buf = buf.split(b"\n")
        objs = [json.loads(line) for line in lines if line.strip()]
        if objs:
            yield objs
    if buf.strip():
        yield [json.loads(buf)]


_Item = list[dict[str, Any]] | BaseException | None  # a batch, a failure, the end


class WatchReader:
    """One watch request, read by a daemon thread of its own: `open()` returns once the
    server has answered the request (or raises its refusal), then iterating yields the
    events of each chunk as it completes, and ends when the server ends the watch.
    `close()` (from any thread) shuts the socket, which wakes a read in progress."""

    def __init__(self, api: client.ApiClient, path: str, query: dict[str, Any],
                 timeout: Timeout, name: str = "watch") -> None:
        self._api, self._path, self._query, self._timeout = api, path, query, timeout
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._resp: urllib3.BaseHTTPResponse | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._read, name=name, daemon=True)

    async def open(self) -> None:
        self._thread.start()
        try:
            first = await self._queue.get()
        except asyncio.CancelledError:
            # still waiting for the response headers: nothing to shut; the daemon thread
            # ends at the request's own timeout
            self.close()
            raise
        if isinstance(first, BaseException):
            await self.aclose()
            raise first

    def __aiter__(self) -> WatchReader:
        return self

    async def __anext__(self) -> list[dict[str, Any]]:
        item = await self._queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        with self._lock:
            self._closed = True
            resp, self._resp = self._resp, None
        if resp is not None:
            with contextlib.suppress(Exception):
                resp.shutdown()  # unblocks a read in progress in the reader thread
            with contextlib.suppress(Exception):
                resp.close()

    async def aclose(self) -> None:
        """Close, and wait (up to 10 s) for the reader thread to end: it ends as soon as
        its socket is shut; a request still waiting for the response headers ends at
        its own timeout (it is a daemon thread)."""
        self.close()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 10.0)

    def _put(self, item: _Item) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown)
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _read(self) -> None:
        resp: urllib3.BaseHTTPResponse | None = None
        try:
            resp = request(self._api, "GET", self._path, query=self._query,
                           timeout=self._timeout)
            with self._lock:
                if self._closed:
                    raise ConnectionResetError("the watch was closed while it was opened")
                self._resp = resp
            self._put([])  # open: the server took the request
            for events in json_lines(resp.stream(65536, decode_content=True)):
                self._put(events)
            self._put(None)
        except Exception as e:  # handed to the loop, which decides
            self._put(e)
        finally:
            with self._lock:
                if self._resp is resp:
                    self._resp = None
            if resp is not None:
                with contextlib.suppress(Exception):
                    resp.close()
