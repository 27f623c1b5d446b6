"""Pod volumes: set up on the host before containers are created (manager.py), with
the kubelet's atomic `..data` layout for API data (atomic.py), service account tokens
from the TokenRequest API (tokens.py) and tmpfs for memory-backed emptyDirs (mount.py)."""

from nodeagent.pods.volumes.manager import (
    MountFailed,
    PodVolumes,
    VolumeManager,
    VolumeRefused,
    on_the_loop,
)
from nodeagent.pods.volumes.mount import HostMounter, Mounter
from nodeagent.pods.volumes.tokens import TokenManager

__all__ = ["HostMounter", "MountFailed", "Mounter", "PodVolumes", "TokenManager",
           "VolumeManager", "VolumeRefused", "on_the_loop"]
