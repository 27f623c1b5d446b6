"""The manifest URL source (`--manifest-url`, `--manifest-url-header`).

Polled every `check_frequency` seconds (20 s, the kubelet's httpCheckFrequency) with
`If-None-Match` / `If-Modified-Since` from the last response: a 304 costs no parsing,
a 200 whose bytes are unchanged costs a digest, and only new bytes are parsed. The
body is one Pod, a PodList/List of Pods, or several YAML documents of Pods.

A failed request or a bad body (any bad pod in it) changes nothing: the last good set
keeps running, the problem is reported once (log, metric, Node Event) until it changes.
The source is ready after its first good body.

Limits: a body over `max_bytes` (16 MiB) is refused from its Content-Length before it
is read, and without one after reading at most `max_bytes` + 1 bytes, so a huge or
endless body never sits in memory; a request gives up after `timeout` seconds
without progress, and a body not complete `timeout` seconds after the request is
abandoned (checked between reads, so at most twice `timeout` in all). A pod with a
host namespace or a privileged container is refused (the whole body, like any bad pod)
unless `allow_privileged`.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

from nodeagent.api.clock import Clock
from nodeagent.pods.podupdate import Pod, Source, pod_uid
from nodeagent.pods.sources import sourcemetrics
from nodeagent.pods.sources.merge import Merge
from nodeagent.pods.sources.static import (
    ManifestError,
    check_host_access,
    make_static_pod,
    parse_pod_list,
    static_uid,
)

log = logging.getLogger("nodeagent.pods.sources")

MAX_BODY_BYTES = 16 << 20


class _TooLarge(ValueError):
    pass


@dataclass
class _Response:
    status: int
    body: bytes
    etag: str | None
    last_modified: str | None


class HTTPSource:
    max_bytes = MAX_BODY_BYTES

    def __init__(self, url: str, node_name: str, merge: Merge, clock: Clock, *,
                 headers: Mapping[str, str] | None = None, check_frequency: float = 20.0,
                 timeout: float = 10.0, allow_privileged: bool = False) -> None:
        """Problems are reported through the merge's (merge.problems)."""
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--manifest-url {url!r}: only http:// and https:// URLs")
        self.url = url
        self.node_name = node_name
        self.merge = merge
        self.clock = clock
        self.headers = dict(headers or {})
        self.problems = merge.problems
        self.check_frequency = check_frequency
        self.timeout = timeout
        self.allow_privileged = allow_privileged
        self._etag: str | None = None
        self._last_modified: str | None = None
        self._digest: bytes | None = None
        self._pods: dict[str, Pod] = {}  # uid -> pod of the last good body
        self._problem: str | None = None
        self.polls = 0

    async def run(self) -> None:
        while True:
            await self.poll()
            await self.clock.sleep(self.check_frequency)

    async def poll(self) -> str:
        """One poll; returns the result (not_modified, unchanged, changed, error)."""
        self.polls += 1
        result = await self._poll()
        sourcemetrics.HTTP_POLLS.labels(result).inc()
        return result

    async def _poll(self) -> str:
        try:
            resp = await asyncio.to_thread(self._fetch)
        except _TooLarge as e:
            self._fail("TooLarge", str(e))
            return "error"
        except (OSError, ValueError) as e:
            reason = getattr(e, "reason", None) or e
            self._fail("Unreachable", f"GET {self.url} failed: {reason}")
            return "error"
        if resp.status == 304:
            return "not_modified"
        if resp.status != 200:
            self._fail("HTTPError", f"GET {self.url}: HTTP {resp.status}")
            return "error"
        if len(resp.body) > self.max_bytes:
            self._fail("TooLarge", f"GET {self.url}: body over the limit of "
                       f"{self.max_bytes} bytes")
            return "error"
        digest = hashlib.blake2b(resp.body, digest_size=16).digest()
        self._etag, self._last_modified = resp.etag, resp.last_modified
        if digest == self._digest:
            return "unchanged"
        self._digest = digest
        try:
            docs = parse_pod_list(resp.body, self.url)
            pods: dict[str, Pod] = {}
            for doc in docs:
                if not self.allow_privileged:
                    name = f"{doc['metadata']['namespace']}/{doc['metadata']['name']}"
                    check_host_access(doc, f"{self.url} (pod {name})")
                uid = static_uid(doc, Source.HTTP, self.node_name)
                pods[uid] = self._pods.get(uid) or make_static_pod(
                    doc, Source.HTTP, self.node_name, self.clock.now())
        except ManifestError as e:
            self._fail(e.reason, str(e))
            return "error"
        if self._problem is not None:
            log.info("http source: %s is good again", self.url)
        self._problem = None
        self._pods = pods
        self.merge.set(Source.HTTP, list(pods.values()))
        return "changed"

    def _fail(self, reason: str, message: str) -> None:
        if self._pods:
            message += f"; keeping the last good set ({len(self._pods)} pods)"
        if message != self._problem:
            self._problem = message
            self.problems.report(Source.HTTP, reason, message)

    def _fetch(self) -> _Response:
        headers = dict(self.headers)
        if self._etag:
            headers["If-None-Match"] = self._etag
        if self._last_modified:
            headers["If-Modified-Since"] = self._last_modified
        req = urllib.request.Request(self.url, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                length = r.headers.get("Content-Length")
                if length is not None and length.isdigit() and int(length) > self.max_bytes:
                    raise _TooLarge(f"GET {self.url}: Content-Length {length} is over the "
                                    f"limit of {self.max_bytes} bytes; not read")
                body = self._read_body(r)
                return _Response(r.status, body, r.headers.get("ETag"),
                                 r.headers.get("Last-Modified"))
        except urllib.error.HTTPError as e:
            e.close()
            return _Response(e.code, b"", None, None)

    def _read_body(self, r: http.client.HTTPResponse) -> bytes:
        """At most max_bytes + 1 bytes, all within `timeout` s of the request: a body
        trickling in a byte at a time never holds the source (nor its thread)."""
        deadline = time.monotonic() + self.timeout
        chunks: list[bytes] = []
        size = 0
        while size <= self.max_bytes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the body was not complete within {self.timeout:.0f}s "
                                   f"({size} bytes came)")
            chunk = r.read1(min(65536, self.max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)

    def current(self) -> list[Pod]:
        """The last good set (what the merge has from this source)."""
        return sorted(self._pods.values(), key=pod_uid)
