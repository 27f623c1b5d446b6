"""The kubelet API server's side of hostile clients, on loopback with a stand-in for a
runtime's streaming server: an exec/attach/port-forward stream leaves no connection
behind once it ends, a stream idle for streamingConnectionIdleTimeout is closed (on
the fake clock), and a malformed request is a 400 and a debug line, not a traceback
in the log."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from nodeagent.api.clock import FakeClock, settle
from nodeagent.runtime.base import StreamRequest
from nodeagent.runtime.fake import FakeRuntime
from nodeagent.server.kubeletserver import KubeletServer
from tests.conftest import aio, kubelet_server, until

NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)


class Echo:
    """A runtime's streaming server in miniature: 101 to any request, then every byte
    back."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.open = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/stream/x"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                         b"Upgrade: SPDY/3.1\r\n\r\n")
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.open -= 1
            writer.close()


class StreamingRuntime(FakeRuntime):
    def __init__(self, clock: FakeClock, url: str) -> None:
        super().__init__(clock)
        self.url = url

    async def exec_url(self, container_id: str, cmd: list[str], req: StreamRequest) -> str:
        return self.url


@contextlib.asynccontextmanager
async def serving(tmp: Path, **settings: float) -> AsyncIterator[tuple[KubeletServer, Echo,
                                                                        FakeClock]]:
    echo = Echo()
    url = await echo.start()
    clock = FakeClock(NOW)
    server = kubelet_server(tmp, NOW, StreamingRuntime(clock, url), clock=clock, **settings)
    await server.start()
    try:
        yield server, echo, clock
    finally:
        await server.stop()
        assert echo.server is not None
        echo.server.close()


async def exec_upgrade(server: KubeletServer) -> tuple[asyncio.StreamReader,
                                                       asyncio.StreamWriter]:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=ctx)
    writer.write(b"POST /exec/ns/web/main?command=sh&input=1&output=1 HTTP/1.1\r\n"
                 b"Host: x\r\nAuthorization: Bearer good-alice\r\nConnection: Upgrade\r\n"
                 b"Upgrade: SPDY/3.1\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 101"), head
    return reader, writer


def open_connections(server: KubeletServer) -> float | None:
    return server.registry.get_sample_value("nodepulse_kubelet_api_connections")


def streams(server: KubeletServer) -> float | None:
    return server.registry.get_sample_value("nodepulse_kubelet_api_streams",
                                            {"endpoint": "exec"})


@aio
async def test_an_ended_stream_leaves_no_connection_behind(tmp_path: Path) -> None:
    async with serving(tmp_path) as (server, echo, _):
        tasks = server.registry.get_sample_value("nodepulse_asyncio_tasks")
        assert tasks
        for _ in range(3):
            reader, writer = await exec_upgrade(server)
            writer.write(b"ping")
            assert await asyncio.wait_for(reader.readexactly(4), 10) == b"ping"
            assert open_connections(server) == 1 and streams(server) == 1
            writer.close()
            await until(lambda: open_connections(server) == 0 and streams(server) == 0
                        and echo.open == 0, "the connection gone from the server")
            await until(lambda: server.registry.get_sample_value("nodepulse_asyncio_tasks")
                        == tasks, "the stream's tasks gone")


@aio
async def test_a_stream_idle_past_streaming_connection_idle_timeout_is_closed(
        tmp_path: Path) -> None:
    async with serving(tmp_path, streaming_idle_timeout=60.0) as (server, echo, clock):
        reader, writer = await exec_upgrade(server)
        for _ in range(8):  # bytes every 30 s: never idle for 60
            await clock.advance(30)
            writer.write(b"x")
            assert await asyncio.wait_for(reader.readexactly(1), 10) == b"x"
        await clock.advance(59)
        await settle()
        assert not reader.at_eof()
        await clock.advance(16)  # checked every quarter of the timeout
        await until(lambda: reader.at_eof() or bool(reader.exception()), "closed")
        await until(lambda: open_connections(server) == 0 and echo.open == 0,
                    "both sides closed")
        writer.close()


@aio
async def test_a_malformed_request_is_a_400_and_no_traceback(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with serving(tmp_path) as (server, _, _):
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        with caplog.at_level(logging.DEBUG):
            for bad in (b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
                        b"GET /healthz HTTP/1.1\r\n" + b"X: y\r\n" * 200 + b"\r\n",
                        b"GET /healthz HTTP/1.1\r\nHost x\r\n\r\n"):
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port,
                                                               ssl=ctx)
                writer.write(bad)
                answer = await asyncio.wait_for(reader.read(), 10)
                assert answer.startswith(b"HTTP/1.0 400") or answer.startswith(b"HTTP/1.1 400")
                writer.close()
        noisy = [r for r in caplog.records if r.levelno > logging.DEBUG]
        assert not noisy, [r.getMessage() for r in noisy]
        assert any("kubelet API: Error handling request" in r.getMessage()
                   for r in caplog.records)


@aio
async def test_a_body_is_not_read_and_its_connection_closes_after_the_answer(
        tmp_path: Path) -> None:
    async with serving(tmp_path) as (server, _, _):
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        for auth in (b"", b"Authorization: Bearer good-alice\r\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=ctx)
            writer.write(b"POST /exec/ns/ghost/main?command=sh&input=1 HTTP/1.1\r\nHost: x\r\n"
                         + auth + b"Content-Length: 1073741824\r\n\r\n" + b"\0" * 2**20)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.split(b" ")[1] == (b"404" if auth else b"401"), head
            await until(lambda: open_connections(server) == 0, "the connection closed")
            writer.close()
