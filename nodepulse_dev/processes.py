"""Stopping the processes this package (or a test) started, by their handle."""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    """SIGTERM a process we started, SIGKILL it if it has not exited in `timeout`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
