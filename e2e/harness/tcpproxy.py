"""A loopback TCP proxy that tests can cut, to put a network fault between one client
(a node agent) and its server (the API server) while both keep running.

    proxy = TcpProxy("127.0.0.1", api_port).start()   # listens on proxy.port
    proxy.cut()      # drop every open connection; new ones are accepted and then
                     # blackholed (nothing forwarded, no answer), as a partition does
    proxy.resume()   # close the blackholed ones; forward again
    proxy.stop()     # close everything, the listener included

TLS passes through untouched (the client still verifies the server's certificate):
proxied_kubeconfig() points a client's kubeconfig at the proxy. Threads, one pair per
connection; everything is closed by stop().
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from pathlib import Path

import yaml

log = logging.getLogger(__name__)


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, listen_host: str = "127.0.0.1",
                 listen_port: int = 0) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server((listen_host, listen_port))
        self._listener.settimeout(0.2)  # the accept loop looks at `_stopping` this often
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()      # forwarded connections (both ends)
        self._held: set[socket.socket] = set()      # accepted while cut, never answered
        self._cut = False
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"tcpproxy-{self.port}")
        # counters for tests
        self.accepted = 0
        self.forwarded = 0
        self.blackholed = 0
        self.dropped = 0

    # -- control --
    def start(self) -> TcpProxy:
        self._thread.start()
        return self

    @property
    def is_cut(self) -> bool:
        return self._cut

    def cut(self) -> None:
        """Stop forwarding: every open connection is closed at once (both sides), and
        connections made from now on are accepted but blackholed until resume()."""
        with self._lock:
            self._cut = True
            conns, self._open = self._open, set()
            self.dropped += len(conns) // 2
        for s in conns:
            _close(s)

    def resume(self) -> None:
        """Forward again; the connections held while cut are closed (their clients
        retry, as after a real partition heals and stale connections reset)."""
        with self._lock:
            self._cut = False
            held, self._held = self._held, set()
        for s in held:
            _close(s)

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(5)
        _close(self._listener)
        with self._lock:
            conns = self._open | self._held
            self._open, self._held = set(), set()
        for s in conns:
            _close(s)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- work --
    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener was closed
            self.accepted += 1
            with self._lock:
                if self._cut:
                    self._held.add(client)
                    self.blackholed += 1
                    continue
            threading.Thread(target=self._connect, args=(client,), daemon=True,
                             name=f"tcpproxy-{self.port}-conn").start()

    def _connect(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            _close(client)  # the server is down: the client sees its connection end
            return
        upstream.settimeout(None)
        with self._lock:
            if self._cut or self._stopping.is_set():
                held = self._cut and not self._stopping.is_set()
                if held:
                    self._held.add(client)
                    self.blackholed += 1
            else:
                held = None
                self._open.update((client, upstream))
                self.forwarded += 1
        if held is not None:
            _close(upstream)
            if not held:
                _close(client)
            return
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True,
                             name=f"tcpproxy-{self.port}-pump").start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass  # closed by cut(), stop() or the other side
        with self._lock:
            self._open.discard(src)
            self._open.discard(dst)
        # one side ended: end the whole connection, as a proxy does
        _close(src)
        _close(dst)


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        s.close()


def proxied_kubeconfig(source: Path, port: int, out: Path) -> Path:
    """A copy of the kubeconfig `source` with the server moved to the proxy's port (same
    IP, so the serving certificate still verifies)."""
    cfg = yaml.safe_load(source.read_text())
    for c in cfg["clusters"]:
        c["cluster"]["server"] = f"https://127.0.0.1:{port}"
    out.write_text(yaml.safe_dump(cfg))
    out.chmod(0o600)
    return out
