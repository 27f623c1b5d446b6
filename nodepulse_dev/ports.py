"""Free loopback ports for the processes the local cluster (and the tests) start."""

from __future__ import annotations

import socket

_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now and that this process has not handed out before:
    the kernel offers a closed port again, so two processes started one after the other
    could be given the same one while the first is still starting (CI: a restarted
    agent found its port taken by another agent restarted with it)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port
