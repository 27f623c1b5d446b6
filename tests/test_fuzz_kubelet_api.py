"""Fuzzing what a hostile client of the kubelet API sends to parsers of ours: the log
options (the query of /containerLogs), the path and its route (which endpoint, which
subresource is authorized), the Authorization header and client certificate fields,
and SPDY/3.1 frames and header blocks (nodeagent.runtime.spdy, and the process
runtime's exec sessions that read them).

Whatever the input, the parser returns or raises the project's own clear error
(LogRequestError, Unauthorized, spdy.ProtocolError); the server answers a 4xx naming
the problem, never a 500; and no request reaches an endpoint its subresource was not
authorized for.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import struct
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from nodeagent.api.clock import FakeClock
from nodeagent.runtime import spdy
from nodeagent.runtime.execserver import RESIZE_LIMIT, STDIN_BUFFER, ExecSpec, Session
from nodeagent.server.auth import KubeletAuth, Unauthorized, request_attributes
from nodeagent.server.containerlogs import LogRequestError, parse_options
from nodeagent.server.kubeletserver import KubeletServer
from tests.conftest import KubeletApiFake, NoTls, kubelet_server

FUZZ = settings(max_examples=int(os.environ.get("NP_FUZZ_EXAMPLES", "200")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)

# -- log options --

LOG_KEYS = ["follow", "previous", "timestamps", "tailLines", "tail", "limitBytes",
            "sinceSeconds", "sinceTime", "stream", "other"]
# what matters to each parser: numbers at the edges, times half-right, words
LOG_VALUES = st.one_of(
    st.text(max_size=40),
    st.integers(min_value=-2**70, max_value=2**70).map(str),
    st.sampled_from(["", "all", "true", "false", "1", "0", "T", "All", "Stdout", "Stderr",
                     "1e3", " 5", "5 ", "0x10", "١٢", "nan", "inf", "-0",
                     "2026-01-02T03:04:05Z", "2026-01-02T03:04:05.123456789+02:00",
                     "2026-01-02T03:04:05", "9999-12-31T23:59:59Z", "0001-01-01T00:00:00Z",
                     "2026-13-02T03:04:05Z", "2026-01-02T03:04:05.Z", "2026-01-02 03:04:05z",
                     "2026-01-02T03:04:05+99:00", "2026-01-02T03:04:05." + "9" * 50 + "Z"]))


@FUZZ
@given(st.dictionaries(st.sampled_from(LOG_KEYS), LOG_VALUES, max_size=6))
def test_log_options_parse_or_are_refused_by_name(query: dict[str, str]) -> None:
    try:
        opts = parse_options(query, NOW)
    except LogRequestError as e:
        assert e.status in (400, 422)
        assert any(k in str(e) for k in LOG_KEYS), str(e)
        return
    assert opts.tail_lines is None or opts.tail_lines >= 0
    assert opts.limit_bytes is None or opts.limit_bytes >= 1
    assert opts.stream in ("All", "Stdout", "Stderr")


# -- routes and who may reach them --

SEGMENTS = st.sampled_from([
    "containerLogs", "exec", "attach", "portForward", "run", "pods", "stats", "summary",
    "metrics", "resource", "healthz", "logs", "configz", "checkpoint", "ns", "web", "main",
    "u1", "", ".", "..", "%2e%2e", "%2E%2e%2F", "..%2F..", "%2F", "%252F", "%00", "%",
    "etc", "passwd", "\\..\\", "~", ";", "a;b=c", "%ff", "\u00e9", "*"])
QUERIES = st.lists(st.tuples(
    st.sampled_from(["command", "input", "output", "error", "tty", "port", "tailLines",
                     "follow", "previous", "sinceTime", "limitBytes", "stream",
                     "only_cpu_and_memory", "x"]),
    st.sampled_from(["1", "0", "true", "-1", "", "sh", "80", "0,70000", "abc", "%",
                     "a&b", "999999999999999999999"])), max_size=4)
USERS = st.sampled_from([None, "alice", "stan", "mallory", "garbage"])
METHODS = st.sampled_from(["GET", "POST", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS",
                           "BREW", ""])


def authorization(user: str | None) -> dict[str, str]:
    if user is None:
        return {}
    if user == "garbage":
        return {"Authorization": "Bearer"}
    return {"Authorization": f"Bearer good-{user}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> KubeletServer:
    """One server for every example (each server starts a child process to make its
    certificate)."""
    return kubelet_server(tmp_path_factory.mktemp("fuzz"), NOW)


@FUZZ
@given(METHODS, st.lists(SEGMENTS, max_size=7), st.booleans(), QUERIES, USERS,
       st.sampled_from([{}, {"Connection": "Upgrade", "Upgrade": "SPDY/3.1"},
                        {"Connection": "keep-alive, upgrade", "Upgrade": "websocket"}]))
def test_any_path_is_answered_4xx_or_served_only_when_authorized(
        server: KubeletServer, method: str, segments: list[str], slash: bool,
        query: list[tuple[str, str]], user: str | None, upgrade: dict[str, str]) -> None:
    path = "/" + "/".join(segments) + ("/" if slash else "")
    if query:
        path += "?" + "&".join(f"{k}={v}" for k, v in query)
    try:
        request = make_mocked_request(method, path, headers={**authorization(user),
                                                             **upgrade},
                                      transport=NoTls())
    except ValueError:  # aiohttp's parser refuses it before us (400)
        assume(False)
        return
    resp = asyncio.run(server._dispatch(request))
    assert resp.status != 500, (method, path, getattr(resp, "text", ""))
    if user in (None, "garbage", "mallory"):
        assert resp.status in (401, 403), (method, path, resp.status)
    elif resp.status not in (401, 403):
        # served: the subresource its route needs was allowed for this user
        endpoint = next((p for p in request.path.split("/") if p), "")
        needed = "stats" if endpoint == "stats" else "proxy"
        assert (user, needed) in {("alice", "proxy"), ("stan", "stats")}, \
            (method, path, user, resp.status)


@FUZZ
@given(st.text(max_size=60), st.sampled_from(["GET", "POST", "PUT", "X", ""]))
def test_request_attributes_of_any_path(path: str, method: str) -> None:
    verb, subresources = request_attributes(method, path)
    assert subresources and set(subresources) <= {
        "pods", "healthz", "configz", "stats", "metrics", "log", "checkpoint", "statusz",
        "proxy"}
    # only a path under its own prefix gets a narrower subresource than proxy
    if not path.startswith(("/pods", "/healthz", "/configz", "/runningpods", "/stats",
                            "/metrics", "/logs", "/checkpoint", "/statusz", "/flagz")):
        assert subresources == ["proxy"], (path, subresources)


# -- credentials --

CERT_FIELDS = st.sampled_from(["commonName", "organizationName", "countryName", "", "x"])


@FUZZ
@given(st.one_of(st.none(), st.text(max_size=80),
                 st.sampled_from(["Bearer", "Bearer ", "bearer good-alice", "Basic abc",
                                  "Bearer  good-alice  ", "Bearer good-", "BEARER x y z",
                                  "Bearer\tgood-alice", "Negotiate", " "])),
       st.one_of(st.none(), st.just({}), st.fixed_dictionaries({"subject": st.lists(
           st.lists(st.tuples(CERT_FIELDS, st.text(max_size=20)), max_size=3).map(tuple),
           max_size=4).map(tuple)})))
def test_credentials_give_a_user_or_unauthorized(authorization: str | None,
                                                 peercert: dict[str, Any] | None) -> None:
    clock = FakeClock(NOW)
    auth = KubeletAuth(KubeletApiFake(set()), clock)

    async def run() -> None:
        try:
            user = await auth.authenticate(authorization, peercert)
        except Unauthorized:
            return
        assert user.name, (authorization, peercert, user)
    asyncio.run(run())


# -- SPDY frames --

def frames_of(data: bytes) -> list[spdy.Frame]:
    buf = bytearray(data)
    out = []
    while (f := spdy.parse(buf)) is not None:
        out.append(f)
    return out


CONTROL_TYPES = st.sampled_from([spdy.SYN_STREAM, spdy.SYN_REPLY, spdy.RST_STREAM,
                                 spdy.SETTINGS, spdy.PING, spdy.GOAWAY, spdy.HEADERS,
                                 spdy.WINDOW_UPDATE, 0, 5, 10, 0xFFFF])


def header_block(codec: spdy.HeaderCodec, headers: dict[str, str]) -> bytes:
    return codec.encode(headers)


FRAME = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda kind, flags, payload: spdy.control(kind, flags, payload),
              CONTROL_TYPES, st.integers(0, 255), st.binary(max_size=40)),
    st.builds(spdy.data, st.integers(0, 2**31 - 1), st.binary(max_size=40), st.booleans()),
    # a control frame whose length field lies
    st.builds(lambda kind, length, payload: struct.pack(">HHI", 0x8003, kind, length) + payload,
              CONTROL_TYPES, st.integers(0, 2**24 - 1), st.binary(max_size=16)))


@FUZZ
@given(st.lists(FRAME, max_size=8))
def test_spdy_frames_parse_or_are_a_protocol_error(chunks: list[bytes]) -> None:
    with contextlib.suppress(spdy.ProtocolError):
        for f in frames_of(b"".join(chunks)):
            assert len(f.data) < spdy.MAX_FRAME


@FUZZ
@given(st.lists(st.one_of(
    st.binary(max_size=80),
    st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=4).map(
        lambda h: spdy.HeaderCodec().encode(h)),
    st.builds(lambda n, rest: zlib.compress(struct.pack(">I", n) + rest),
              st.integers(0, 2**32 - 1), st.binary(max_size=40))), max_size=4))
def test_spdy_header_blocks_decode_or_are_a_protocol_error(blocks: list[bytes]) -> None:
    codec = spdy.HeaderCodec()
    for block in blocks:
        try:
            headers = codec.decode(block)
        except spdy.ProtocolError:
            return  # the connection's compression context is gone: the session ends
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())


def test_a_header_block_that_inflates_past_the_limit_is_refused_small() -> None:
    """A zlib bomb: 64 MiB of header block in 64 KiB on the wire."""
    bomb = zlib.compressobj(zdict=spdy.DICTIONARY)
    block = bomb.compress(struct.pack(">I", 1) + b"\0" * (64 << 20)) + \
        bomb.flush(zlib.Z_SYNC_FLUSH)
    assert len(block) < 128 * 1024
    tracemalloc.start()
    try:
        with pytest.raises(spdy.ProtocolError, match="header block"):
            spdy.HeaderCodec().decode(block)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # not the 64 MiB it inflates to


# -- the process runtime's exec sessions, fed frames --

class Writer:
    def __init__(self) -> None:
        self.out = bytearray()

    def write(self, data: bytes) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return False

    async def drain(self) -> None:
        pass


def session(tty: bool = False) -> tuple[Session, asyncio.StreamReader, Writer]:
    reader = asyncio.StreamReader()
    writer = Writer()
    spec = ExecSpec(["cat"], {}, "/", stdin=True, stdout=True, stderr=not tty, tty=tty)
    return Session(reader, writer, spec), reader, writer  # type: ignore[arg-type]


def syn_stream(codec: spdy.HeaderCodec, sid: int, kind: str, fin: bool = False) -> bytes:
    return spdy.control(spdy.SYN_STREAM, spdy.FLAG_FIN if fin else 0,
                        struct.pack(">IIH", sid, 0, 0) + codec.encode({"streamtype": kind}))


SESSION_FRAME = st.one_of(
    FRAME,
    st.builds(lambda sid, kind, fin: syn_stream(spdy.HeaderCodec(), sid, kind, fin),
              st.integers(0, 9), st.sampled_from(["stdin", "stdout", "resize", "error",
                                                  "x", ""]), st.booleans()),
    st.builds(spdy.data, st.integers(0, 9), st.binary(max_size=200), st.booleans()))


@FUZZ
@given(st.lists(SESSION_FRAME, max_size=12), st.booleans())
def test_exec_session_reads_any_frames_or_ends_with_a_protocol_error(
        chunks: list[bytes], tty: bool) -> None:
    async def run() -> None:
        s, reader, _ = session(tty)
        reader.feed_data(b"".join(chunks))
        reader.feed_eof()
        with contextlib.suppress(spdy.ProtocolError):
            await asyncio.wait_for(s._read_frames(), 5)
        assert s.gone.is_set()
    asyncio.run(run())


def _queued(q: asyncio.Queue[bytes | None]) -> int:
    pending: list[bytes | None] = list(q._queue)  # type: ignore[attr-defined]
    return sum(len(x or b"") for x in pending)


def test_stdin_a_command_does_not_read_holds_the_client_back() -> None:
    """Stdin frames wait in the session only up to STDIN_BUFFER; past it the session
    stops reading the socket, as a pipe would, instead of queueing without end."""
    async def run() -> None:
        s, reader, _ = session()
        codec = spdy.HeaderCodec()
        reader.feed_data(b"".join(syn_stream(codec, i + 1, k) for i, k in
                                  enumerate(("error", "stdin", "stdout", "stderr"))))
        chunk = b"x" * 32768
        reader.feed_data(b"".join(spdy.data(2, chunk) for _ in range(128)))  # 4 MiB
        frames = asyncio.create_task(s._read_frames())
        for _ in range(200):
            await asyncio.sleep(0)
        assert s.all_there.is_set()
        assert _queued(s.stdin_queue) <= STDIN_BUFFER + 65536  # and one read
        # the command reads: the rest comes through
        got = 0
        while got < 128 * len(chunk):
            piece = await asyncio.wait_for(s.stdin_chunk(), 5)
            got += len(piece or b"")
        reader.feed_eof()
        await asyncio.wait_for(frames, 5)
    asyncio.run(run())


def test_resize_messages_are_bounded() -> None:
    """A resize stream without newlines, or on a session without a terminal, holds at
    most one message's worth of bytes."""
    async def run() -> None:
        for tty in (False, True):
            s, reader, _ = session(tty)
            codec = spdy.HeaderCodec()
            reader.feed_data(syn_stream(codec, 1, "resize"))
            reader.feed_data(b"".join(spdy.data(1, b"{" * 32768) for _ in range(64)))
            reader.feed_data(spdy.data(1, b'{"Width":80,"Height":24}\n' * 1000))
            reader.feed_eof()
            await asyncio.wait_for(s._read_frames(), 5)
            assert len(s._resize_buf) <= RESIZE_LIMIT
            assert s.resizes.qsize() <= (1 if tty else 0)
    asyncio.run(run())


def test_since_seconds_further_back_than_the_calendar_is_every_line() -> None:
    for seconds in ("63902919846", str(2**70)):
        assert parse_options({"sinceSeconds": seconds}, NOW).since is None


@pytest.mark.parametrize("path", ["/%2F/stats", "/%2F%2F/stats/summary", "/%2Fstats/summary"])
def test_empty_segments_do_not_change_the_subresource_needed(tmp_path: Path,
                                                             path: str) -> None:
    """A path routed as /stats needs nodes/stats however many (encoded) slashes lead
    it: alice, who has nodes/proxy only, is refused; stan, who has nodes/stats, is
    served. (A path that starts "//" is another URL: its first segment is a host.)"""
    server = kubelet_server(tmp_path, NOW)
    for user, status in (("alice", 403), ("stan", 200)):
        request = make_mocked_request("GET", path, headers=authorization(user),
                                      transport=NoTls())
        assert asyncio.run(server._dispatch(request)).status == status, (user, path)
