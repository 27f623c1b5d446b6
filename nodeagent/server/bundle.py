"""The kubelet API's server and what runs beside it, started and stopped together (built
by nodeagent.agent.build_kubelet_api)."""

from __future__ import annotations

import asyncio
import contextlib

from nodeagent.api.kube import Kube
from nodeagent.config import ConfigError
from nodeagent.server.kubeletserver import KubeletServer
from nodeagent.server.tls import ServingCert


class ServerBundle:
    """The server and what runs beside it (serving-certificate rotation)."""

    def __init__(self, server: KubeletServer, cert: ServingCert, kube: Kube,
                 rotate: bool) -> None:
        self.server = server
        self.cert = cert
        self.kube = kube  # the serving certificate's CSRs
        self.rotate = rotate
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        if self.rotate:
            self._task = asyncio.create_task(self.cert.rotate(self.kube, self._stop),
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
