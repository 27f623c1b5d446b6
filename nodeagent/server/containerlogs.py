"""Container logs as the kubelet serves them: `/containerLogs/{ns}/{pod}/{container}`.

Reads the file the runtime writes (CRI format `<RFC 3339 time> <stream> <P|F> <text>`,
or a runtime's raw bytes) and streams it: at most one 64 KiB block is held at a time,
whatever `tailLines` asks or however fast a followed file grows, and each block is
written (with the socket's back-pressure) before the next is read, so a slow client
costs memory for one block and never blocks anyone else.

`follow` waits for the file to change through one inotify descriptor shared by every
follower (FileWatch), survives rotation (the file renamed away and a new one created:
the old one is read to its end, then the new one from its start) and ends once the
container no longer runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from nodeagent.runtime.logfile import BLOCK, Formatter, LogOptions, parse_time, tail_offset

log = logging.getLogger(__name__)

FOLLOW_CHECK = 2.0  # seconds between checks that a followed container still runs
STREAMS = ("All", "Stdout", "Stderr")


class LogRequestError(ValueError):
    """A bad log request; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


_TRUE = ("1", "t", "T", "true", "TRUE", "True")
_FALSE = ("0", "f", "F", "false", "FALSE", "False")


def _bool(query: Mapping[str, str], name: str) -> bool:
    value = query.get(name)
    if value is None or value == "":
        return False
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise LogRequestError(400, f"query parameter {name}: {value!r} is not true or false")


def _int(query: Mapping[str, str], name: str) -> int | None:
    value = query.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise LogRequestError(400, f"query parameter {name}: {value!r} is not a whole "
                                   "number") from None


def parse_options(query: Mapping[str, str], now: dt.datetime) -> LogOptions:
    """The query's options, refused like the kubelet refuses them: a value that does
    not parse is 400, a combination or range PodLogOptions forbids is 422."""
    q = dict(query)
    tail = q.pop("tail", None)  # the kubelet's older name for tailLines; "all" is none
    if tail is not None and tail != "all":
        q["tailLines"] = tail
    since_time = q.get("sinceTime")
    since: dt.datetime | None = None
    if since_time:
        try:
            since = parse_time(since_time)
        except ValueError:
            raise LogRequestError(400, f"query parameter sinceTime: {since_time!r} is not "
                                       "an RFC 3339 time") from None
    since_seconds = _int(q, "sinceSeconds")
    tail_lines = _int(q, "tailLines")
    limit = _int(q, "limitBytes")
    stream = q.get("stream") or "All"
    if since_seconds is not None and since_time:
        raise LogRequestError(422, "sinceSeconds and sinceTime cannot both be set")
    if since_seconds is not None:
        if since_seconds < 1:
            raise LogRequestError(422, f"sinceSeconds: must be at least 1, got {since_seconds}")
        try:
            since = now - dt.timedelta(seconds=since_seconds)
        except OverflowError:  # further back than the calendar goes: every line
            since = None
    if tail_lines is not None and tail_lines < 0:
        raise LogRequestError(422, f"tailLines: must not be negative, got {tail_lines}")
    if limit is not None and limit < 1:
        raise LogRequestError(422, f"limitBytes: must be at least 1, got {limit}")
    if stream not in STREAMS:
        raise LogRequestError(400, f"stream: must be one of {', '.join(STREAMS)}, "
                                   f"got {stream!r}")
    if stream != "All" and tail_lines is not None:
        raise LogRequestError(422, "tailLines cannot be used with a stream other than All")
    return LogOptions(follow=_bool(q, "follow"), previous=_bool(q, "previous"),
                      timestamps=_bool(q, "timestamps"), tail_lines=tail_lines,
                      limit_bytes=limit, since=since, stream=stream)


def check_format(fmt: str, opts: LogOptions, runtime: str) -> None:
    """What a raw log (no times, one mixed stream) cannot answer is refused by name."""
    if fmt == "cri":
        return
    asked = [name for name, on in (("timestamps", opts.timestamps),
                                   ("sinceSeconds/sinceTime", opts.since is not None),
                                   (f"stream={opts.stream}", opts.stream != "All")) if on]
    if asked:
        raise LogRequestError(400, f"{', '.join(asked)}: the {runtime} runtime writes a "
                                   "container's output as it comes, without times or "
                                   "separate streams, so this cannot be answered")


Writer = Callable[[bytes], Awaitable[None]]


class FileWatch:
    """Change notices for followed log files, from one inotify descriptor for all
    followers (none where inotify is missing: followers then look every
    FOLLOW_CHECK seconds)."""

    def __init__(self) -> None:
        self._inotify: Any = None
        self._flags = 0
        self._events: dict[int, set[asyncio.Event]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def _start(self) -> bool:
        if self._inotify is not None:
            return True
        try:
            import inotify_simple
            self._inotify = inotify_simple.INotify()
        except (ImportError, OSError) as e:
            log.warning("no inotify (%s): followed logs are looked at every %.0f s", e,
                        FOLLOW_CHECK)
            return False
        f = inotify_simple.flags
        self._flags = f.MODIFY | f.MOVE_SELF | f.DELETE_SELF | f.ATTRIB | f.CLOSE_WRITE
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._inotify.fileno(), self._read)
        return True

    def _read(self) -> None:
        for ev in self._inotify.read(timeout=0):
            for event in self._events.get(ev.wd, ()):
                event.set()

    def add(self, path: str, event: asyncio.Event) -> int | None:
        """Set `event` whenever the file now at `path` changes; the watch id to remove."""
        if not self._start():
            return None
        try:
            wd = int(self._inotify.add_watch(path, self._flags))
        except OSError:
            return None
        self._events.setdefault(wd, set()).add(event)
        return wd

    def remove(self, wd: int | None, event: asyncio.Event) -> None:
        if wd is None:
            return
        holders = self._events.get(wd)
        if holders is None:
            return
        holders.discard(event)
        if not holders:
            del self._events[wd]
            with contextlib.suppress(OSError):
                self._inotify.rm_watch(wd)

    @property
    def watches(self) -> int:
        return len(self._events)

    def close(self) -> None:
        if self._inotify is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._inotify.fileno())
            self._inotify.close()
            self._inotify = None
        self._events.clear()


async def stream_log(path: str, fmt: str, opts: LogOptions, write: Writer, *,
                     running: Callable[[], bool] | None = None,
                     watch: FileWatch | None = None) -> None:
    """Write the log at `path` to `write`, following it while `running()` when asked."""
    formatter = Formatter(fmt, opts)
    try:
        f = open(path, "rb")  # noqa: SIM115 - swapped for the new file on rotation
    except FileNotFoundError:
        raise LogRequestError(404, f"log file {path} does not exist (yet)") from None
    except OSError as e:
        raise LogRequestError(500, f"log file {path}: {e.strerror}") from None
    changed = asyncio.Event()
    wd = watch.add(path, changed) if (opts.follow and watch) else None
    try:
        size = os.fstat(f.fileno()).st_size
        if opts.tail_lines is not None:
            f.seek(tail_offset(f, opts.tail_lines, size))
        else:
            f.seek(0)
        rest = b""
        while True:
            changed.clear()  # before reading: a write after the last read wakes us
            rest = await _read_to_end(f, rest, formatter, write)
            if formatter.done:
                return
            if not opts.follow:
                if rest:
                    await _flush(formatter, rest, write)
                return
            # rotated? read the old file to its end (above), then switch to the new
            with contextlib.suppress(OSError):
                if os.stat(path).st_ino != os.fstat(f.fileno()).st_ino:
                    f.close()
                    f = open(path, "rb")  # noqa: SIM115
                    if watch:
                        watch.remove(wd, changed)
                        wd = watch.add(path, changed)
                    continue
            if running is not None and not running():
                # the container ended: whatever it wrote last is in the file now
                rest = await _read_to_end(f, rest, formatter, write)
                if rest:
                    await _flush(formatter, rest, write)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), FOLLOW_CHECK)
    finally:
        f.close()
        if watch:
            watch.remove(wd, changed)


async def _read_to_end(f: Any, rest: bytes, formatter: Formatter, write: Writer) -> bytes:
    """Format and write every complete line from the file's position to its end, one
    block at a time; return the incomplete last line (if any)."""
    while not formatter.done:
        block = f.read(BLOCK)
        if not block:
            return rest
        data = rest + block
        out = bytearray()
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                break
            formatter.line(data[start:nl + 1], out)
            start = nl + 1
        rest = data[start:]
        if len(rest) >= BLOCK:  # a line longer than a block: pass it on in pieces
            if formatter.cri:
                log.debug("log line over %d bytes without a newline, skipped", BLOCK)
            else:
                formatter.line(rest, out)
            rest = b""
        if out:
            await write(bytes(out))
    return rest


async def _flush(formatter: Formatter, rest: bytes, write: Writer) -> None:
    out = bytearray()
    formatter.line(rest, out)
    if out:
        await write(bytes(out))
