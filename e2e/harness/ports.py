"""Loopback ports for the processes the tests and benchmarks start, and which ports a
process listens on."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from nodepulse_dev.ports import free_port

__all__ = ["free_port", "listening"]


def _decode(hexaddr: str) -> tuple[str, int]:
    addr, port = hexaddr.split(":")
    raw = bytes.fromhex(addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words), int(port, 16)


def listening(pid: int | None = None) -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets in LISTEN state, of one process or all."""
    inodes: set[str] | None = None
    if pid is not None:
        inodes = set()
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and (inodes is None or f[9] in inodes):
                out.add(_decode(f[1]))
    return out
