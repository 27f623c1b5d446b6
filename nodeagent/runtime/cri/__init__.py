"""CRI v1 over gRPC (containerd). The messages we use are in api.proto (package
runtime.v1, official names and field numbers); gen/ holds the generated stubs."""

from nodeagent.runtime.cri.criruntime import CriRuntime, map_error

__all__ = ["CriRuntime", "map_error"]
