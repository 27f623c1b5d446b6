"""exec on the process runtime: its streaming server speaks remotecommand v4 over
SPDY/3.1 (a client written here from the framing rules plays kubectl's part)."""

from __future__ import annotations

import asyncio
import json
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest

from nodeagent.runtime import spdy
from nodeagent.runtime.base import (
    ContainerConfig,
    ContainerRuntimeError,
    RuntimeTimeout,
    SandboxConfig,
    StreamRequest,
)
from nodeagent.runtime.process import ProcessRuntime
from tests.conftest import aio


def test_the_header_dictionary_is_spdy3s() -> None:
    # its length and the zlib dictionary id a SPDY/3 peer's deflate stream names
    assert len(spdy.DICTIONARY) == 1423
    assert zlib.adler32(spdy.DICTIONARY) == 3821447106


def test_header_blocks_round_trip() -> None:
    a, b = spdy.HeaderCodec(), spdy.HeaderCodec()
    b._in = zlib.decompressobj(zdict=spdy.DICTIONARY)
    for headers in ({"streamtype": "stdin"}, {}, {"x": "y" * 1000, "streamtype": "error"}):
        assert b.decode(a.encode(headers)) == headers


class Client:
    """The client side of an exec: upgrade, one stream per channel, frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.codec = spdy.HeaderCodec()
        self.buf = bytearray()
        self.got: dict[int, bytearray] = {}
        self.done: set[int] = set()

    def open(self, sid: int, kind: str) -> None:
        block = self.codec.encode({"streamtype": kind})
        self.writer.write(spdy.control(spdy.SYN_STREAM, 0,
                                       struct.pack(">IIBB", sid, 0, 0, 0) + block))

    async def frames_until(self, sid: int) -> None:
        while sid not in self.done:
            chunk = await self.reader.read(65536)
            if not chunk:
                return
            self.buf += chunk
            while (f := spdy.parse(self.buf)) is not None:
                if f.control and f.type == spdy.SYN_REPLY:
                    self.codec.decode(f.data)
                elif not f.control:
                    self.got.setdefault(f.stream_id, bytearray()).extend(f.data)
                    if f.flags & spdy.FLAG_FIN:
                        self.done.add(f.stream_id)


async def exec_in(rt: ProcessRuntime, cid: str, cmd: list[str], stdin: bytes) -> Client:
    url = await rt.exec_url(cid, cmd, StreamRequest(stdin=True, stdout=True, stderr=True))
    host, _, rest = url[len("http://"):].partition(":")
    port, _, path = rest.partition("/")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST /{path} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                 "Upgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: v5.channel.k8s.io\r\n"
                 "X-Stream-Protocol-Version: v4.channel.k8s.io\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101"), head
    assert b"X-Stream-Protocol-Version: v5.channel.k8s.io" in head
    c = Client(reader, writer)
    for sid, kind in ((1, "error"), (3, "stdin"), (5, "stdout"), (7, "stderr")):
        c.open(sid, kind)
    writer.write(spdy.data(3, stdin, fin=True))
    await asyncio.wait_for(c.frames_until(1), 30)
    writer.close()
    return c


@aio
async def test_exec_runs_beside_the_container_with_its_environment(tmp_path: Path) -> None:
    rt = ProcessRuntime(tmp_path / "state")
    try:
        pod: dict[str, Any] = {
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {"containers": [{"name": "c", "image": "i", "command": ["sleep", "60"],
                                     "env": [{"name": "GREETING", "value": "hello"}]}]}}
        sc = SandboxConfig.from_pod(pod, log_root=str(tmp_path / "logs"))
        sid = await rt.run_sandbox(sc)
        cid = await rt.create_container(sid, ContainerConfig.from_pod(
            pod, pod["spec"]["containers"][0]), sc)
        await rt.start_container(cid)
        c = await exec_in(rt, cid, ["sh", "-c", "read x; echo $GREETING:$x; echo oops >&2; "
                                                "exit 3"], b"world\n")
        assert bytes(c.got[5]) == b"hello:world\n"
        assert bytes(c.got[7]) == b"oops\n"
        status = json.loads(bytes(c.got[1]))
        assert status["reason"] == "NonZeroExitCode"
        assert status["details"]["causes"] == [{"reason": "ExitCode", "message": "3"}]
        c = await exec_in(rt, cid, ["true"], b"")
        assert json.loads(bytes(c.got[1])) == {"metadata": {}, "status": "Success"}
        # a used token is gone
        url = await rt.exec_url(cid, ["true"], StreamRequest())
        reader, writer = await asyncio.open_connection(*url[7:].split("/")[0].split(":"))
        writer.write(b"POST /exec/not-a-token HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 404")
        writer.close()
        await rt.stop_container(cid, 1)
    finally:
        await rt.close()


@aio
async def test_exec_sync_runs_probe_commands_to_completion(tmp_path: Path) -> None:
    """What exec probes and hooks use: exit code and output, killed at the timeout."""
    rt = ProcessRuntime(tmp_path / "state")
    try:
        pod: dict[str, Any] = {
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {"containers": [{"name": "c", "image": "i", "command": ["sleep", "60"],
                                     "env": [{"name": "GREETING", "value": "hello"}]}]}}
        sc = SandboxConfig.from_pod(pod, log_root=str(tmp_path / "logs"))
        sid = await rt.run_sandbox(sc)
        cid = await rt.create_container(sid, ContainerConfig.from_pod(
            pod, pod["spec"]["containers"][0]), sc)
        await rt.start_container(cid)
        r = await rt.exec_sync(cid, ["sh", "-c", "echo $GREETING; echo bad >&2; exit 4"], 5)
        assert (r.exit_code, r.stdout, r.stderr) == (4, b"hello\n", b"bad\n")
        assert (await rt.exec_sync(cid, ["no-such-program-here"], 5)).exit_code == 127
        with pytest.raises(RuntimeTimeout, match='command "sleep 30" timed out'):
            await rt.exec_sync(cid, ["sleep", "30"], 0.2)
        await rt.stop_container(cid, 1)
        with pytest.raises(ContainerRuntimeError, match="not running"):
            await rt.exec_sync(cid, ["true"], 5)
    finally:
        await rt.close()
