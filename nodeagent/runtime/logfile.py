"""A container's log file, read as the runtime writes it: the CRI format
(`<RFC 3339 time> <stream> <P|F> <text>`, a partial line going on in the next) or a
runtime's raw bytes, turned into what a reader asked for (stream, since, timestamps,
limitBytes), a block at a time. The kubelet API serves logs with it
(nodeagent.server.containerlogs); the pod half reads a failed container's last lines
with it (its termination message).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from typing import Any

log = logging.getLogger(__name__)

BLOCK = 64 * 1024


@dataclasses.dataclass(frozen=True)
class LogOptions:
    """PodLogOptions, as the kubelet reads them from the query."""
    follow: bool = False
    previous: bool = False
    timestamps: bool = False
    tail_lines: int | None = None
    limit_bytes: int | None = None
    since: dt.datetime | None = None  # from sinceSeconds or sinceTime
    stream: str = "All"


def parse_time(text: str) -> dt.datetime:
    """RFC 3339 with any number of fraction digits (Go writes up to nine)."""
    t = text.strip()
    if t.endswith(("Z", "z")):
        t = t[:-1] + "+00:00"
    date, sep, rest = t.partition(".")
    if sep:  # cut the fraction to microseconds, keep the offset
        digits = len(rest) - len(rest.lstrip("0123456789"))
        t = f"{date}.{rest[:min(digits, 6)]}{rest[digits:]}" if digits else date + rest[digits:]
    parsed = dt.datetime.fromisoformat(t)
    if parsed.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone")
    return parsed


def tail_offset(f: Any, lines: int, size: int) -> int:
    """Offset of the first of the last `lines` lines of the file, reading backwards a
    block at a time (a huge tailLines costs no more memory than a small one)."""
    if lines == 0:
        return size
    end = size
    # a final newline ends the last line; it does not start another
    if size:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            end = size - 1
    found = 0
    pos = end
    while pos > 0:
        start = max(0, pos - BLOCK)
        f.seek(start)
        block = f.read(pos - start)
        i = len(block)
        while True:
            i = block.rfind(b"\n", 0, i)
            if i < 0:
                break
            found += 1
            if found == lines:
                return start + i + 1
        pos = start
    return 0


class Formatter:
    """Log file lines in, what the client sees out (stream filter, since, timestamps,
    limitBytes)."""

    def __init__(self, fmt: str, opts: LogOptions) -> None:
        self.cri = fmt == "cri"
        self.opts = opts
        self.left = opts.limit_bytes  # bytes still allowed, None: no limit
        self.want = {"All": (b"stdout", b"stderr"), "Stdout": (b"stdout",),
                     "Stderr": (b"stderr",)}[opts.stream]
        self._since_ok = opts.since is None  # times only grow: once past since, stop parsing

    @property
    def done(self) -> bool:
        return self.left is not None and self.left <= 0

    def line(self, raw: bytes, out: bytearray) -> None:
        """One line of the file (its newline, if it had one, included)."""
        if self.done:
            return
        if not self.cri:
            self._emit(raw, out)
            return
        parts = raw.split(b" ", 3)
        if len(parts) < 3:
            log.debug("log line not in CRI format, skipped: %r", raw[:80])
            return
        stamp, stream, tag = parts[0], parts[1], parts[2]
        text = parts[3] if len(parts) == 4 else b""
        if stream not in self.want:
            return
        if not self._since_ok:
            try:
                t = parse_time(stamp.decode())
            except (ValueError, UnicodeDecodeError):
                return
            assert self.opts.since is not None
            if t < self.opts.since:
                return
            self._since_ok = True
        if tag.rstrip(b"\n").split(b":")[0] == b"P":  # a partial line goes on in the next
            text = text.rstrip(b"\n")
        elif text and not text.endswith(b"\n"):
            text += b"\n"
        elif not text:
            text = b"\n"
        if self.opts.timestamps:
            text = stamp + b" " + text
        self._emit(text, out)

    def _emit(self, data: bytes, out: bytearray) -> None:
        if self.left is not None:
            data = data[:self.left]
            self.left -= len(data)
        out += data
