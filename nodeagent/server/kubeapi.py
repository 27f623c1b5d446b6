"""Every API call the kubelet API server's requests make, in one place: TokenReview
and SubjectAccessReview (webhook authentication and authorization). Serving-certificate
rotation sends its CertificateSigningRequests through nodeagent.api.certificates.

Through the one API layer (nodeagent.api.kube), on the server's own few threads
(setup.py hands it a Kube on them): a TokenReview never waits behind pod status writes.
tests/ replace this class with an in-memory one.
"""

from __future__ import annotations

from typing import Any, Protocol

from nodeagent.api.kube import SUBJECT_ACCESS_REVIEWS, TOKEN_REVIEWS, Kube

TIMEOUT = 10.0
Obj = dict[str, Any]


class ServerApi(Protocol):
    async def review_token(self, token: str) -> Obj: ...
    async def review_access(self, spec: Obj) -> Obj: ...


class RealServerApi:
    def __init__(self, kube: Kube) -> None:
        self.kube = kube

    async def review_token(self, token: str) -> Obj:
        """The TokenReview's status: authenticated, user {username, uid, groups, extra}."""
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "spec": {"token": token}}
        out = await self.kube.create(TOKEN_REVIEWS, body, timeout=TIMEOUT)
        return dict(out.get("status") or {})

    async def review_access(self, spec: Obj) -> Obj:
        """The SubjectAccessReview's status: allowed, denied, reason."""
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                "spec": spec}
        out = await self.kube.create(SUBJECT_ACCESS_REVIEWS, body, timeout=TIMEOUT)
        return dict(out.get("status") or {})
