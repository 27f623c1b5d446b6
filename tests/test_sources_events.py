"""Warning Events on the Node: shape, and the same problem written once per period."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.api.client import new_api_client
from nodeagent.api.clock import FakeClock
from nodeagent.sources.events import NodeEvents
from tests.test_merge import aio
from tests.test_sources_api import FakeAPIServer, kubeconfig, serving


@pytest.fixture
def server() -> Iterator[FakeAPIServer]:
    yield from serving()


def test_events_are_shaped_and_deduplicated(server: FakeAPIServer, tmp_path: Path) -> None:
    server.nodes["n1"] = "node-uid-1"

    async def main() -> None:
        clock = FakeClock()
        api = new_api_client(kubeconfig(tmp_path, server.url))
        ev = NodeEvents(api, "n1", clock, repeat_after=600.0)
        ev.warning("StaticPodMalformed", "file source: /m/a.yaml: malformed")
        ev.warning("StaticPodMalformed", "file source: /m/a.yaml: malformed")
        ev.warning("StaticPodTooLarge", "file source: /m/b.yaml: too large")
        await asyncio.wait_for(ev.drain(), 5)
        posts = [(p, b) for verb, p, b in server.writes if verb == "POST"]
        # posted concurrently: events of different reasons carry no order
        assert sorted(b["reason"] for _, b in posts) == ["StaticPodMalformed",
                                                         "StaticPodTooLarge"]
        path, body = next((p, b) for p, b in posts if b["reason"] == "StaticPodMalformed")
        assert path == "/api/v1/namespaces/default/events"
        assert body["type"] == "Warning" and body["message"].endswith("a.yaml: malformed")
        assert body["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": "n1",
                                          "uid": "node-uid-1"}
        assert body["firstTimestamp"] == "2026-01-01T00:00:00.000000Z"
        await clock.advance(600.0)
        ev.warning("StaticPodMalformed", "file source: /m/a.yaml: malformed")
        await asyncio.wait_for(ev.drain(), 5)
        assert len([w for w in server.writes if w[0] == "POST"]) == 3 and ev.written == 3
        api.close()
    aio(main())


def test_an_event_failure_is_not_fatal(tmp_path: Path) -> None:
    async def main() -> None:
        api = new_api_client(kubeconfig(tmp_path, "http://127.0.0.1:9"))
        ev = NodeEvents(api, "n1", FakeClock())
        ev.warning("StaticPodMalformed", "x")
        await asyncio.wait_for(ev.drain(), 30)
        assert ev.written == 0
        api.close()
    aio(main())


def test_an_event_not_written_is_posted_at_the_next_report(server: FakeAPIServer,
                                                            tmp_path: Path) -> None:
    async def main() -> None:
        api = new_api_client(kubeconfig(tmp_path, server.url))
        ev = NodeEvents(api, "n1", FakeClock(), repeat_after=600.0)
        ev.warning("StaticPodMalformed", "file source: /m/a.yaml: malformed")
        await asyncio.wait_for(ev.drain(), 5)
        assert ev.written == 0  # the Node is not registered yet: 404
        server.nodes["n1"] = "node-uid-1"
        ev.warning("StaticPodMalformed", "file source: /m/a.yaml: malformed")
        await asyncio.wait_for(ev.drain(), 5)
        assert ev.written == 1
        api.close()
    aio(main())
