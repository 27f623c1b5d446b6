"""The API source: pods bound to this node (or to a set of nodes), list then watch.

Listing (paginated, `fieldSelector=spec.nodeName=<node>`: what the Node authorizer
lets a node's own credentials read), watching from the list's resourceVersion with
bookmarks, resuming when a stream ends, relisting only on 410 Gone (as a streaming list,
a watch with `sendInitialEvents`, while the server serves one) and backing off are the
reflector's (nodeagent.api.reflector). What is this source's own: every full set goes to
`Merge.set`, which emits only the differences against what this source delivered
before, and every event to `Merge.upsert`/`Merge.remove`.

Several nodes (virtual-node mode): with more than one name, one watch covers all bound
pods (`fieldSelector=spec.nodeName!=`) and pods of other nodes are dropped here by
`spec.nodeName` (which never changes once set). That needs credentials allowed to list
all pods (a service account), not a node's own. Pods carry their `spec.nodeName`, so
consumers route them.

Pods are dicts (the JSON body is parsed once, no model objects).
"""

from __future__ import annotations

from collections.abc import Iterable

from nodeagent.api.answered import ApiAnswered
from nodeagent.api.clock import Clock
from nodeagent.api.kube import PODS, Kube, Obj
from nodeagent.api.reflector import Reflector, ReflectorConfig
from nodeagent.pods.podupdate import Pod, Source
from nodeagent.pods.sources import sourcemetrics
from nodeagent.pods.sources.merge import Merge


class APISource:
    def __init__(self, kube: Kube, node_names: Iterable[str], merge: Merge, clock: Clock, *,
                 answered: ApiAnswered | None = None, page_size: int = 500,
                 watch_timeout: float = 300.0, streaming_relist: bool = True) -> None:
        self.nodes = frozenset(node_names)
        if not self.nodes:
            raise ValueError("the API source needs at least one node name")
        self.merge = merge
        self.reflector = Reflector(kube, ReflectorConfig(
            PODS, "api source",
            field_selector=(f"spec.nodeName={next(iter(self.nodes))}" if len(self.nodes) == 1
                            else "spec.nodeName!="),
            page_size=page_size, watch_timeout=watch_timeout, backoff_initial=0.5,
            backoff_max=30.0, streaming_relist=streaming_relist),
            self, clock, answered=answered, metrics=sourcemetrics.API_WATCH)

    async def run(self) -> None:
        await self.reflector.run()

    def _keep(self, pod: Pod) -> bool:
        """Whether the pod is bound to one of our nodes, and so kept; a kept pod drops
        its managedFields here: nothing reads them, the agent keeps every pod it runs,
        and they are 43 % of the JSON of a running pod of bench.scale's churn."""
        if pod.get("spec", {}).get("nodeName") not in self.nodes:
            return False
        pod.get("metadata", {}).pop("managedFields", None)
        return True

    # -- what the reflector hands over --
    def on_list(self, items: list[Obj]) -> None:
        pods = []
        for pod in items:
            if self._keep(pod):
                pod.setdefault("apiVersion", "v1")  # a LIST's items leave them out
                pod.setdefault("kind", "Pod")
                pods.append(pod)
        self.merge.set(Source.API, pods)

    def on_events(self, events: list[tuple[str, Obj]]) -> None:
        for kind, pod in events:
            if not self._keep(pod):
                continue
            if kind in ("ADDED", "MODIFIED"):
                self.merge.upsert(Source.API, pod)
            elif kind == "DELETED":
                self.merge.remove(Source.API, pod)
