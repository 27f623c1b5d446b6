"""Every API call the kubelet API server makes, in one place: TokenReview and
SubjectAccessReview (webhook authentication and authorization), and the
CertificateSigningRequest calls of serving-certificate rotation.

Blocking calls (the agent's raw-JSON requests, nodeagent.api.rest); the server runs
them on its own few threads. tests/ replaces this class with an in-memory one.
"""

from __future__ import annotations

from typing import Any, Protocol

from kubernetes import client

from nodeagent.api.rest import request_json

TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"
CSRS = "/apis/certificates.k8s.io/v1/certificatesigningrequests"
TIMEOUT = 10.0
Obj = dict[str, Any]


class ServerApi(Protocol):
    def review_token(self, token: str) -> Obj: ...
    def review_access(self, spec: Obj) -> Obj: ...
    def create_csr(self, body: Obj) -> Obj: ...
    def get_csr(self, name: str) -> Obj: ...


class RealServerApi:
    def __init__(self, api: client.ApiClient) -> None:
        self.api = api

    def review_token(self, token: str) -> Obj:
        """The TokenReview's status: authenticated, user {username, uid, groups, extra}."""
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "spec": {"token": token}}
        out: Obj = request_json(self.api, "POST", TOKEN_REVIEWS, body=body, timeout=TIMEOUT)
        return dict(out.get("status") or {})

    def review_access(self, spec: Obj) -> Obj:
        """The SubjectAccessReview's status: allowed, denied, reason."""
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                "spec": spec}
        out: Obj = request_json(self.api, "POST", ACCESS_REVIEWS, body=body, timeout=TIMEOUT)
        return dict(out.get("status") or {})

    def create_csr(self, body: Obj) -> Obj:
        out: Obj = request_json(self.api, "POST", CSRS, body=body, timeout=TIMEOUT)
        return out

    def get_csr(self, name: str) -> Obj:
        out: Obj = request_json(self.api, "GET", f"{CSRS}/{name}", timeout=TIMEOUT)
        return out
