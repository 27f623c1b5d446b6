"""Builds the kubelet API server from the agent's settings (called by nodeagent.agent)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry

from nodeagent.api.clock import Clock
from nodeagent.api.kube import Kube
from nodeagent.config import AgentConfig, ConfigError
from nodeagent.server.auth import KubeletAuth
from nodeagent.server.kubeapi import RealServerApi, ServerApi
from nodeagent.server.kubeletserver import HealthCheck, KubeletServer
from nodeagent.server.podhost import PodHost
from nodeagent.server.tls import CertError, ServingCert


class ServerBundle:
    """The server and what runs beside it (serving-certificate rotation)."""

    def __init__(self, server: KubeletServer, cert: ServingCert, api: ServerApi,
                 rotate: bool) -> None:
        self.server = server
        self.cert = cert
        self.api = api
        self.rotate = rotate
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        if self.rotate:
            self._task = asyncio.create_task(self.cert.rotate(self.api, self._stop),
                                             name="serving-cert")
            # the interim (or saved) certificate is in the context before we listen
            await asyncio.sleep(0)
        try:
            return await self.server.start()
        except OSError as e:
            await self.stop()
            raise ConfigError(f"--address/--port: cannot listen on {self.server.address}:"
                              f"{self.server.port}: {e.strerror or e}") from e

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self.server.stop()


def build(cfg: AgentConfig, host: PodHost, kube: Kube, *, clock: Clock,
          registry: CollectorRegistry, addresses: Sequence[str],
          health_checks: Mapping[str, HealthCheck]) -> ServerBundle:
    assert cfg.port is not None
    names = [*addresses, *cfg.node_names, socket.gethostname().lower()]
    try:
        cert = ServingCert(node=cfg.node_name, names=names,
                           pki_dir=Path(cfg.root_dir) / "pki", cert_file=cfg.tls_cert_file,
                           key_file=cfg.tls_private_key_file,
                           client_ca_file=cfg.client_ca_file, clock=clock)
        if cfg.tls_cert_file:
            cert.load_files()
        elif not cfg.rotate_server_certificates:
            cert.load_self_signed()
        elif cert.load_current() is None:
            cert.load_self_signed()  # until the first CSR is signed
    except CertError as e:
        raise ConfigError(str(e)) from None
    # connections of our own: the API's TokenReviews must not wait behind pod status writes
    api = RealServerApi(kube.separate(4))
    auth = KubeletAuth(api, clock, anonymous=cfg.anonymous_auth)
    server = KubeletServer(host, auth, cert, node_names=cfg.node_names, clock=clock,
                           registry=registry, address=cfg.address, port=cfg.port,
                           health_checks=health_checks,
                           connection_idle_timeout=cfg.connection_idle_timeout,
                           streaming_idle_timeout=cfg.streaming_connection_idle_timeout)
    return ServerBundle(server, cert, api, cfg.rotate_server_certificates)
