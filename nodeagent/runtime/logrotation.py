"""Container log rotation by size and count (--container-log-max-size,
--container-log-max-files), the kubelet's scheme:

every period, each running container whose log file has reached the size limit gets
it rotated: `<log>` becomes `<log>.<YYYYmmdd-HHMMSS>` and the container writes a fresh
`<log>` (the runtime's rotate_container_log); earlier rotated files are gzipped; of
those, the oldest are removed so that with the new rotated file and the current one
there are at most max-files. Leftovers of a rotation that failed half-way (`.tmp`
files, a file next to its own `.gz`) are removed first.
"""

from __future__ import annotations

import asyncio
import glob
import gzip
import logging
import os
import shutil
from collections.abc import Callable, Iterable

from nodeagent.api.clock import Clock
from nodeagent.runtime.base import ContainerRuntimeError, Runtime, Unsupported

log = logging.getLogger(__name__)

PERIOD = 10.0  # seconds, the kubelet's containerLogMonitorInterval
STAMP = "%Y%m%d-%H%M%S"


def _compress(path: str) -> None:
    tmp = path + ".tmp"
    with open(path, "rb") as src, gzip.open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.replace(tmp, path + ".gz")
    os.remove(path)


def tidy(path: str, max_files: int) -> list[str]:
    """Clean up the rotated files of `path` and compress them; keep room for the one
    about to be made. Returns what is left, oldest first."""
    rotated = sorted(glob.glob(glob.escape(path) + ".*"))
    kept = []
    for f in rotated:
        if f.endswith(".tmp") or (not f.endswith(".gz") and f + ".gz" in rotated):
            os.remove(f)  # a compression that did not finish, or one that did
        else:
            kept.append(f)
    excess = len(kept) - max(0, max_files - 2)
    for f in kept[:max(0, excess)]:
        os.remove(f)
    kept = kept[max(0, excess):]
    for i, f in enumerate(kept):
        if not f.endswith(".gz"):
            _compress(f)
            kept[i] = f + ".gz"
    return kept


class LogRotation:
    BATCH = 200  # logs checked between turns of the event loop

    def __init__(self, runtime: Runtime, running_logs: Callable[[], Iterable[tuple[str, str]]],
                 clock: Clock, *, max_size: int, max_files: int, period: float = PERIOD) -> None:
        """`running_logs`: (container id, log path) of every running container."""
        self.runtime = runtime
        self.running_logs = running_logs
        self.clock = clock
        self.max_size = max_size
        self.max_files = max_files
        self.period = period
        self.rotations = 0
        self.unsupported = False

    async def run(self) -> None:
        while True:
            await self.clock.sleep(self.period)
            await self.rotate_all()

    async def rotate_all(self) -> int:
        """One round; returns how many logs were rotated. Other work runs between
        batches: all at once, 3000 containers' logs stood the event loop still for
        16-23 ms while new pods waited (bench.scale --churn)."""
        done = 0
        for i, (cid, path) in enumerate(self.running_logs()):
            if self.unsupported or not path:
                break
            if i % self.BATCH == self.BATCH - 1:
                await asyncio.sleep(0)
            try:
                size = os.stat(path).st_size
            except OSError:
                continue
            if size < self.max_size:
                continue
            try:
                await self.rotate(cid, path)
                done += 1
            except ContainerRuntimeError as e:
                log.warning("container %s: log %s not rotated: %s", cid, path, e)
            except OSError as e:
                log.warning("container %s: log %s not rotated: %s", cid, path, e)
        self.rotations += done
        return done

    async def rotate(self, cid: str, path: str) -> None:
        await asyncio.to_thread(tidy, path, self.max_files)
        rotated = f"{path}.{self.clock.now().strftime(STAMP)}"
        if os.path.exists(rotated):
            return  # rotated this very second already
        try:
            await self.runtime.rotate_container_log(cid, path, rotated)
        except Unsupported as e:
            self.unsupported = True
            log.warning("container logs are not rotated: %s", e)
            return
        log.info("container %s: log rotated to %s", cid, rotated)
