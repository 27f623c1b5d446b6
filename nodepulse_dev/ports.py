"""Free loopback ports for the processes the local cluster (and the tests) start."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_handed_out: set[int] = set()
_rng = random.Random()
LOWEST = 10000  # above the ports of well-known services


def ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")
                    ) -> tuple[int, int]:
    """The ports the kernel gives outgoing connections (Linux's default if unread)."""
    try:
        low, high = (int(v) for v in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port() -> int:
    """A port nothing listens on now, that this process has not handed out before, and
    below the kernel's ephemeral range. A server stopped and started again on its port
    (etcd, the API server, an agent, in the soak and the fault tests) must find it
    free: in the ephemeral range an outgoing connection made meanwhile may hold it (the
    soak: etcd restarted into "address already in use"). And the kernel offers a
    closed port again, so two processes started one after the other could be given the
    same one while the first is still starting."""
    low = ephemeral_range()[0]
    if low <= LOWEST + 1000:  # a host that left little below it: the kernel's choice
        return _kernel_port()
    while True:
        port = _rng.randrange(LOWEST, low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port


def _kernel_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port
