"""What the unit tests share: running async test bodies, waiting on other threads,
and the builders of the objects they feed in (pods, ...). Import them from here."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from collections.abc import Callable, Coroutine
from typing import Any

from tests.fakekube import FakeKube


def aio(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test body in a fresh event loop (no pytest-asyncio here)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))
    return run


async def until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    """Yield to the event loop (no sleeping) until `pred()` holds, for at most `timeout`
    seconds of real time: for things other threads or the kernel deliver."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0)


class InlineExecutor(concurrent.futures.Executor):
    """Runs each call at once in the caller's thread: blocking work under a FakeClock
    finishes within the test's own steps."""

    def submit(self, fn: Callable[..., Any], /, *args: Any,
               **kwargs: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # delivered to the awaiting coroutine
            fut.set_exception(e)
        return fut


def status_patches(kube: FakeKube) -> list[tuple[str, dict[str, Any]]]:
    """(pod, status) of each pod status PATCH that went through, in order. The pod is
    named by the uid its patch carries (a precondition), or by namespace/name (a static
    pod's status goes to its mirror pod, whose uid is its own)."""
    out = []
    for c in kube.calls_of("patch pods/status", ok=True):
        body = c.body or {}
        who = (body.get("metadata") or {}).get("uid") or f"{c.namespace}/{c.name}"
        out.append((str(who), body["status"]))
    return out


def pod_deletes(kube: FakeKube) -> list[str]:
    """The uids of the pods whose deletion was finished in the API (DELETE, grace 0)."""
    return [str(((c.body or {}).get("preconditions") or {}).get("uid"))
            for c in kube.calls_of("delete pods", ok=True)]
