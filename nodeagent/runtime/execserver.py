"""The process runtime's streaming server: what containerd's is for CRI Exec, for
local processes. `exec_url` registers a command under a one-time token and returns
http://127.0.0.1:<port>/exec/<token>; the kubelet API proxies the client's upgraded
connection there, and this server speaks the remotecommand protocol (v4/v5
channel.k8s.io over SPDY/3.1, what the API server speaks to a kubelet):

the client opens one SPDY stream per channel (header `streamtype`: error, stdin,
stdout, stderr, and resize with a terminal); once all have arrived the command runs
with the container's environment and working directory (and a pty of its own with
tty), its output goes out on stdout/stderr, stdin comes in (FIN closes it), and at
the end a metav1.Status on the error stream says how it ended (NonZeroExitCode with
an ExitCode cause). The command is killed when the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import secrets
import struct
import termios
from dataclasses import dataclass
from typing import Any

from nodeagent.runtime import spdy

log = logging.getLogger(__name__)

PROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")  # same over SPDY
TOKEN_TTL = 60.0      # seconds an unused exec URL stays valid
STREAM_WAIT = 30.0    # seconds for the client to open its streams
HEAD_LIMIT = 64 * 1024
STDIN_BUFFER = 256 * 1024  # stdin bytes waiting for the command before we stop reading
RESIZE_LIMIT = 4096       # bytes of one terminal-size message


@dataclass
class ExecSpec:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    stdin: bool
    stdout: bool
    stderr: bool
    tty: bool


def _status(code: int | None, error: str = "") -> bytes:
    if error:
        body: dict[str, Any] = {"metadata": {}, "status": "Failure", "message": error,
                                "reason": "InternalError", "code": 500}
    elif code == 0:
        body = {"metadata": {}, "status": "Success"}
    else:
        body = {"metadata": {}, "status": "Failure", "reason": "NonZeroExitCode",
                "message": f"command terminated with non-zero exit code: exit status {code}",
                "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]}}
    return json.dumps(body, separators=(",", ":")).encode()


class StreamingServer:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = 0
        self._tokens: dict[str, tuple[float, ExecSpec]] = {}
        self._server: asyncio.Server | None = None
        self._sessions: set[asyncio.Task[None]] = set()

    async def url(self, spec: ExecSpec) -> str:
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, self.host, 0)
            self.port = int(self._server.sockets[0].getsockname()[1])
        now = asyncio.get_running_loop().time()
        for t in [t for t, (at, _) in self._tokens.items() if now - at > TOKEN_TTL]:
            del self._tokens[t]
        token = secrets.token_urlsafe(16)
        self._tokens[token] = (now, spec)
        return f"http://{self.host}:{self.port}/exec/{token}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for t in list(self._sessions):
            t.cancel()
        await asyncio.gather(*self._sessions, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._sessions.add(task)
        try:
            await self._handle(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, spdy.ProtocolError) as e:
            log.debug("exec session ended: %s", e)
        finally:
            self._sessions.discard(task)
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if len(head) > HEAD_LIMIT:
            return
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        headers: dict[str, list[str]] = {}
        for line in lines[1:]:
            k, sep, v = line.partition(":")
            if sep:
                headers.setdefault(k.strip().lower(), []).append(v.strip())
        path = parts[1] if len(parts) > 1 else ""
        found = self._tokens.pop(path.rpartition("/")[2], None) if path.startswith("/exec/") \
            else None
        if found is None:
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 23\r\n\r\n"
                         b"unknown or used token\r\n")
            return
        spec = found[1]
        offered = [p.strip() for v in headers.get("x-stream-protocol-version", [])
                   for p in v.split(",")]
        chosen = next((p for p in offered if p in PROTOCOLS), None)
        upgrade = ",".join(headers.get("upgrade", [])).lower()
        if chosen is None or "spdy/3.1" not in upgrade:
            msg = (f"exec needs an SPDY/3.1 upgrade with one of {', '.join(PROTOCOLS)}; got "
                   f"upgrade {upgrade!r}, protocols {offered}").encode()
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(msg)
                         + msg)
            return
        writer.write(f"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                     f"Upgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: {chosen}\r\n\r\n"
                     .encode())
        await Session(reader, writer, spec).run()


class Session:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 spec: ExecSpec) -> None:
        self.reader = reader
        self.writer = writer
        self.spec = spec
        self.codec = spdy.HeaderCodec()
        self.streams: dict[str, int] = {}  # type -> stream id
        self.want = {"error"} | {k for k in ("stdin", "stdout", "stderr")
                                 if getattr(spec, k) and not (k == "stderr" and spec.tty)}
        if spec.tty:
            self.want.add("resize")
        self.all_there = asyncio.Event()
        self.stdin_queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._stdin_queued = 0
        self._stdin_room = asyncio.Event()
        self.resizes: asyncio.Queue[bytes] = asyncio.Queue(maxsize=1)  # the latest only
        self.gone = asyncio.Event()
        self._resize_buf = b""

    def send(self, frame: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(frame)

    async def _read_frames(self) -> None:
        buf = bytearray()
        try:
            while True:
                chunk = await self.reader.read(65536)
                if not chunk:
                    return
                buf += chunk
                while (frame := spdy.parse(buf)) is not None:
                    self._on_frame(frame)
                if len(buf) > spdy.MAX_FRAME + 8:
                    raise spdy.ProtocolError("frame too long")
                await self.writer.drain()
                # a command that does not read its stdin holds the client back
                while self._stdin_queued > STDIN_BUFFER:
                    self._stdin_room.clear()
                    await self._stdin_room.wait()
        finally:
            self.gone.set()
            self.stdin_queue.put_nowait(None)

    def _on_frame(self, f: spdy.Frame) -> None:
        if not f.control:
            kind = next((k for k, sid in self.streams.items() if sid == f.stream_id), "")
            if kind == "stdin":
                if f.data:
                    self._stdin_queued += len(f.data)
                    self.stdin_queue.put_nowait(f.data)
                if f.flags & spdy.FLAG_FIN:
                    self.stdin_queue.put_nowait(None)
            elif kind == "resize" and self.spec.tty:  # one JSON object per line
                self._resize_buf += f.data
                *msgs, self._resize_buf = self._resize_buf.split(b"\n")
                if len(self._resize_buf) > RESIZE_LIMIT:
                    self._resize_buf = b""  # no terminal size is that long
                if msgs:
                    if self.resizes.full():
                        self.resizes.get_nowait()
                    self.resizes.put_nowait(msgs[-1])
            return
        if f.type == spdy.SYN_STREAM:
            headers = self.codec.decode(f.data[6:])  # after assoc id, priority and slot
            kind = headers.get("streamtype", "")
            self.streams[kind] = f.stream_id
            self.send(spdy.syn_reply(self.codec, f.stream_id))
            if kind == "stdin" and f.flags & spdy.FLAG_FIN:
                self.stdin_queue.put_nowait(None)
            if self.want <= self.streams.keys():
                self.all_there.set()
        elif f.type == spdy.PING:
            self.send(spdy.control(spdy.PING, 0, f.data[:4]))
        elif f.type == spdy.GOAWAY:
            self.gone.set()
        elif f.type in (spdy.HEADERS, spdy.SYN_REPLY):
            self.codec.decode(f.data)  # keeps the compression context in step
        # SETTINGS, WINDOW_UPDATE, RST_STREAM: nothing to do

    async def run(self) -> None:
        frames = asyncio.create_task(self._read_frames())
        try:
            await asyncio.wait_for(self.all_there.wait(), STREAM_WAIT)
        except TimeoutError:
            frames.cancel()
            return
        code: int | None = None
        error = ""
        try:
            code = await self._execute()
        except OSError as e:
            error = f"cannot run {self.spec.argv[0]!r}: {e.strerror or e}"
        if "error" in self.streams:
            self.send(spdy.data(self.streams["error"], _status(code, error), fin=True))
        for kind in ("stdout", "stderr"):
            if kind in self.streams:
                self.send(spdy.data(self.streams[kind], b"", fin=True))
        self.send(spdy.control(spdy.GOAWAY, 0, struct.pack(">II", 0, 0)))
        with contextlib.suppress(ConnectionError):
            await self.writer.drain()
        frames.cancel()

    async def _execute(self) -> int | None:
        s = self.spec
        if s.tty:
            primary, secondary = os.openpty()
            io: dict[str, Any] = {"stdin": secondary, "stdout": secondary, "stderr": secondary}
        else:
            primary = secondary = -1
            io = {"stdin": asyncio.subprocess.PIPE if s.stdin else asyncio.subprocess.DEVNULL,
                  "stdout": asyncio.subprocess.PIPE if s.stdout else asyncio.subprocess.DEVNULL,
                  "stderr": asyncio.subprocess.PIPE if s.stderr else asyncio.subprocess.DEVNULL}

        def controlling_terminal() -> None:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        try:
            proc = await asyncio.create_subprocess_exec(
                *s.argv, env=s.env, cwd=s.cwd, start_new_session=True,
                preexec_fn=controlling_terminal if s.tty else None, **io)
        finally:
            if secondary >= 0:
                os.close(secondary)
        pumps = [asyncio.create_task(self._stdin(proc, primary))]
        if s.tty:
            pumps.append(asyncio.create_task(self._pty_out(primary)))
            pumps.append(asyncio.create_task(self._resize(primary), name="resize"))
        else:
            for kind, stream in (("stdout", proc.stdout), ("stderr", proc.stderr)):
                if stream is not None and kind in self.streams:
                    pumps.append(asyncio.create_task(self._out(kind, stream)))
        waiter = asyncio.create_task(proc.wait())
        gone = asyncio.create_task(self.gone.wait())
        await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():  # the client went away: so does the command
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            await waiter
        gone.cancel()
        outputs = [p for p in pumps[1:] if p.get_name() != "resize"]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*outputs, return_exceptions=True), 5)
        for p in pumps:
            p.cancel()
        if primary >= 0:
            os.close(primary)
        return waiter.result()

    async def stdin_chunk(self) -> bytes | None:
        """The next piece of the client's stdin; None at its end."""
        chunk = await self.stdin_queue.get()
        self._stdin_queued -= len(chunk or b"")
        self._stdin_room.set()
        return chunk

    async def _stdin(self, proc: asyncio.subprocess.Process, pty_fd: int) -> None:
        while (chunk := await self.stdin_chunk()) is not None:
            if pty_fd >= 0:
                await asyncio.to_thread(os.write, pty_fd, chunk)
            elif proc.stdin is not None:
                proc.stdin.write(chunk)
                await proc.stdin.drain()
        if proc.stdin is not None:
            proc.stdin.close()

    async def _out(self, kind: str, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(32768):
            self.send(spdy.data(self.streams[kind], chunk))
            await self.writer.drain()

    async def _pty_out(self, fd: int) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                chunk = await loop.run_in_executor(None, os.read, fd, 32768)
            except OSError:  # EIO: the terminal's last user has gone
                return
            if not chunk:
                return
            if "stdout" in self.streams:
                self.send(spdy.data(self.streams["stdout"], chunk))
                await self.writer.drain()

    async def _resize(self, fd: int) -> None:
        while True:
            msg = await self.resizes.get()
            try:
                size = json.loads(msg)
                fcntl.ioctl(fd, termios.TIOCSWINSZ,
                            struct.pack("HHHH", int(size["Height"]), int(size["Width"]), 0, 0))
            except (ValueError, KeyError, TypeError, OSError):
                log.debug("exec: bad resize message %r", msg[:80])
