"""One watch over the Nodes this process speaks for: each Node goes to its controller.

For a single node it is a single-object watch (fieldSelector metadata.name=<node>, which
is what node credentials may watch); for many virtual nodes, one label-selector watch
(nodepulse.dev/agent=<id>) covers them all. Listing, resuming, relisting and backing
off are the reflector's (nodeagent.api.reflector); what is done with a Node is here.
"""

from __future__ import annotations

from collections.abc import Mapping

from nodeagent.api.answered import ApiAnswered
from nodeagent.api.clock import Clock
from nodeagent.api.kube import NODES, Kube, Obj
from nodeagent.api.policy import AGENT_LABEL
from nodeagent.api.reflector import Reflector, ReflectorConfig
from nodeagent.node.controller import NodeController


class NodeWatch:
    def __init__(self, kube: Kube, nodes: Mapping[str, NodeController], clock: Clock, *,
                 agent_id: str, answered: ApiAnswered | None = None) -> None:
        self.nodes = nodes
        one = len(nodes) == 1
        self.reflector = Reflector(kube, ReflectorConfig(
            NODES, "node watch",
            field_selector=f"metadata.name={next(iter(nodes))}" if one else "",
            label_selector="" if one else f"{AGENT_LABEL}={agent_id}",
            backoff_initial=1.0, backoff_max=8.0), self, clock, answered=answered)

    async def run(self) -> None:
        await self.reflector.run()

    def stop(self) -> None:
        self.reflector.stop()

    # -- what the reflector hands over --
    def on_list(self, items: list[Obj]) -> None:
        for node in items:
            self._deliver("SYNC", node)

    def on_events(self, events: list[tuple[str, Obj]]) -> None:
        for kind, node in events:
            self._deliver(kind, node)

    def _deliver(self, kind: str, obj: Obj) -> None:
        node = self.nodes.get((obj.get("metadata") or {}).get("name", ""))
        if node is None:
            return
        if kind == "DELETED":
            node.deleted()
        else:
            node.on_node(obj)
