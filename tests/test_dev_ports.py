"""Loopback ports for restartable servers (nodepulse_dev/ports.py)."""

from __future__ import annotations

import socket
from pathlib import Path

from nodepulse_dev import ports


def test_ports_are_below_the_ephemeral_range_free_and_never_handed_out_twice() -> None:
    """A server restarted on its port must find it free: an outgoing connection never
    takes a port below the kernel's ephemeral range."""
    low, _ = ports.ephemeral_range()
    given = [ports.free_port() for _ in range(200)]
    assert len(set(given)) == len(given)
    assert all(ports.LOWEST <= p < low for p in given)
    for p in given[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # nothing holds it


def test_the_range_is_read_from_the_kernel_or_defaults(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(f) == (40000, 50000)
    assert ports.ephemeral_range(tmp_path / "absent") == (32768, 60999)
    f.write_text("garbage")
    assert ports.ephemeral_range(f) == (32768, 60999)
