"""Container runtimes behind one interface (base.Runtime). Layers above pick one with
`make_runtime` and never import an implementation directly."""

from __future__ import annotations

import os
from typing import Any

from nodeagent.runtime.base import (
    DEFAULT_CONTAINERD_SOCKET,
    Container,
    ContainerConfig,
    ContainerEvent,
    ContainerEventType,
    ContainerRuntimeError,
    ContainerState,
    ContainerStats,
    ExecResult,
    ImageFsInfo,
    ImageInfo,
    ImageNotPresent,
    NotFound,
    PodRuntimeStatus,
    PullFailed,
    RegistryAuth,
    RelistResult,
    Runtime,
    RuntimeTimeout,
    RuntimeVersion,
    Sandbox,
    SandboxConfig,
    SandboxState,
    StreamRequest,
    Unavailable,
    Unsupported,
)

__all__ = [
    "DEFAULT_CONTAINERD_SOCKET", "Container", "ContainerConfig", "ContainerEvent",
    "ContainerEventType", "ContainerRuntimeError",
    "ContainerState", "ContainerStats", "ExecResult", "ImageFsInfo", "ImageInfo", "ImageNotPresent",
    "NotFound", "PodRuntimeStatus", "PullFailed", "RegistryAuth", "RelistResult", "Runtime",
    "RuntimeTimeout", "RuntimeVersion", "Sandbox",
    "SandboxConfig", "SandboxState", "StreamRequest", "Unavailable", "Unsupported",
    "make_runtime", "socket_path",
]

KINDS = ("auto", "cri", "process", "fake")


def socket_path(endpoint: str | None) -> str:
    """`unix:///run/x.sock` or a plain path -> the filesystem path."""
    ep = endpoint or DEFAULT_CONTAINERD_SOCKET
    return ep[len("unix://"):] if ep.startswith("unix://") else ep


def make_runtime(kind: str = "auto", endpoint: str | None = None, **opts: Any) -> Runtime:
    """Build a runtime by name. Implementations are imported only when chosen.

    - "cri": CriRuntime(endpoint, **opts), CRI v1 over gRPC on a unix socket
      (default /run/containerd/containerd.sock).
    - "process": ProcessRuntime(**opts), containers are local processes.
    - "fake": FakeRuntime(**opts), in memory.
    - "auto": "cri" when the given or default containerd socket exists, else "process".
    """
    if kind not in KINDS:
        raise ValueError(f"runtime: unknown kind {kind!r}, expected one of {', '.join(KINDS)}")
    if kind == "auto":
        kind = "cri" if os.path.exists(socket_path(endpoint)) else "process"
    if kind == "fake":
        from nodeagent.runtime.fake import FakeRuntime
        return FakeRuntime(**opts)
    if kind == "process":
        from nodeagent.runtime.process import ProcessRuntime  # type: ignore[import-not-found,unused-ignore]
        rt: Runtime = ProcessRuntime(**opts)
        return rt
    from nodeagent.runtime.cri import CriRuntime  # type: ignore[attr-defined,unused-ignore]
    cri: Runtime = CriRuntime(socket_path(endpoint), **opts)
    return cri
