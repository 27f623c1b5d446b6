"""Service account tokens for projected volumes, from the TokenRequest API.

Each token is asked for the pod's ServiceAccount, bound to the pod (the API server
invalidates it when the pod goes), with the volume's audience and expirationSeconds; it
is the only kind of token the Node authorizer lets a node request. A token is reused
until 80 % of its life has passed (or 24 hours, whichever comes first), then requested
again: the pod's volume sync is scheduled for that moment, so the file is rewritten
before the old token expires.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nodeagent.api.clock import Clock
from nodeagent.api.kube import SERVICE_ACCOUNTS, Kube

log = logging.getLogger(__name__)

MAX_AGE = 24 * 3600.0  # a token is never kept longer than this
DEFAULT_EXPIRATION = 3600  # the API's default expirationSeconds


@dataclass(frozen=True)
class _Token:
    value: str
    refresh_at: dt.datetime


def _parse_time(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


class TokenManager:
    def __init__(self, kube: Kube, clock: Clock) -> None:
        self.kube = kube
        self.clock = clock
        self._tokens: dict[tuple[str, str, int], _Token] = {}  # (uid, audience, secs)
        self.requests = 0

    async def token(self, pod: Mapping[str, Any], audience: str,
                    expiration: int | None) -> tuple[str, float]:
        """A token for the pod's ServiceAccount bound to the pod, and the seconds until
        it must be refreshed. Raises what the API raises (ApiError)."""
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        secs = int(expiration or DEFAULT_EXPIRATION)
        key = (uid, audience, secs)
        now = self.clock.now()
        held = self._tokens.get(key)
        if held is None or now >= held.refresh_at:
            held = self._tokens[key] = await self._request(pod, audience, secs)
        return held.value, max(0.0, (held.refresh_at - now).total_seconds())

    async def _request(self, pod: Mapping[str, Any], audience: str, secs: int) -> _Token:
        meta = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        ns = str(meta.get("namespace") or "default")
        account = str(spec.get("serviceAccountName") or spec.get("serviceAccount")
                      or "default")
        body: dict[str, Any] = {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": secs, "boundObjectRef": {
                "apiVersion": "v1", "kind": "Pod", "name": meta.get("name"),
                "uid": meta.get("uid")}}}
        if audience:
            body["spec"]["audiences"] = [audience]
        answer = await self.kube.create(SERVICE_ACCOUNTS, body, namespace=ns, name=account,
                                        subresource="token", timeout=30.0)
        self.requests += 1
        status = answer.get("status") or {}
        expires = _parse_time(str(status["expirationTimestamp"]))
        lifetime = int((answer.get("spec") or {}).get("expirationSeconds") or secs)
        issued = expires - dt.timedelta(seconds=lifetime)
        refresh = min(issued + dt.timedelta(seconds=MAX_AGE),
                      expires - dt.timedelta(seconds=lifetime * 0.2))
        log.debug("token for %s/%s (pod %s): expires %s, refreshed at %s", ns, account,
                  meta.get("name"), expires, refresh)
        return _Token(str(status["token"]), refresh)

    def forget(self, uid: str) -> None:
        for key in [k for k in self._tokens if k[0] == uid]:
            del self._tokens[key]
