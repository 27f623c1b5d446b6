"""Who may call the kubelet API: the kubelet's webhook mode.

Authentication: a client certificate the TLS handshake verified against
--client-ca-file (user = its CN, groups = its O values), else a bearer token the API
server vouches for (TokenReview), else anonymous (system:anonymous) only with
--anonymous-auth; nothing of these is 401.

Authorization: every request is a SubjectAccessReview on the Node object's
subresources, the way the kubelet maps them (pkg/kubelet/server/auth.go): /stats/* is
nodes/stats, /metrics* nodes/metrics, /logs/* nodes/log, /pods, /healthz and
/configz first try their own subresource, and everything else (containerLogs, exec,
attach, portForward, ...) is nodes/proxy; the verb comes from the HTTP method.

Answers are cached for short times, as the kubelet's defaults: a token 2 min (30 s
when refused), an allowed review 5 min, a refused one 30 s; lookups of the same key
in flight at once share one API call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Generic, TypeVar

from nodeagent.api.clock import Clock
from nodeagent.server.kubeapi import ServerApi

log = logging.getLogger(__name__)

K = TypeVar("K")
V = TypeVar("V")

TOKEN_TTL = 120.0
TOKEN_REFUSED_TTL = 30.0
ALLOWED_TTL = 300.0
DENIED_TTL = 30.0
MAX_ENTRIES = 4096

ANONYMOUS = "system:anonymous"
UNAUTHENTICATED = "system:unauthenticated"
AUTHENTICATED = "system:authenticated"

_VERBS = {"POST": "create", "GET": "get", "HEAD": "get", "PUT": "update",
          "PATCH": "patch", "DELETE": "delete"}


class Unauthorized(Exception):
    """No credentials, or none the server accepts (HTTP 401)."""


class Forbidden(Exception):
    """Authenticated, but not allowed (HTTP 403); the message says who and what."""


class AuthorizationError(Exception):
    """The API server could not be asked (HTTP 500, as the kubelet answers)."""


@dataclasses.dataclass(frozen=True)
class User:
    name: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()


def _subpath(path: str, prefix: str) -> bool:
    prefix = prefix.rstrip("/")
    return path == prefix or path.startswith(prefix + "/")


def request_attributes(method: str, path: str) -> tuple[str, list[str]]:
    """(verb, subresources to try in order) of a request to the kubelet API."""
    verb = _VERBS.get(method.upper(), "")
    subresources: list[str] = []
    # the kubelet's fine-grained checks (on by default since 1.33), then its fallback
    for prefix, sub in (("/pods", "pods"), ("/healthz", "healthz"), ("/configz", "configz"),
                        ("/runningpods", "pods")):
        if _subpath(path, prefix):
            subresources.append(sub)
            break
    for prefix, sub in (("/stats", "stats"), ("/metrics", "metrics"), ("/logs", "log"),
                        ("/checkpoint", "checkpoint"), ("/statusz", "statusz"),
                        ("/flagz", "configz")):
        if _subpath(path, prefix):
            subresources.append(sub)
            break
    else:
        subresources.append("proxy")
    return verb, subresources


def user_of_certificate(cert: Mapping[str, Any]) -> User | None:
    """The user a verified client certificate names (ssl's getpeercert() form)."""
    cn = ""
    orgs: list[str] = []
    for rdn in cert.get("subject") or ():
        for key, value in rdn:
            if key == "commonName":
                cn = value
            elif key == "organizationName":
                orgs.append(value)
    return User(cn, groups=(*orgs, AUTHENTICATED)) if cn else None


class TtlCache(Generic[K, V]):
    """Answers kept for a time that depends on the answer; concurrent misses of one
    key share one computation. Bounded: the oldest entries go first."""

    def __init__(self, clock: Clock, ttl: Callable[[V], float],
                 max_entries: int = MAX_ENTRIES) -> None:
        self.clock = clock
        self.ttl = ttl
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[K, tuple[float, V]] = OrderedDict()
        self._inflight: dict[K, asyncio.Future[V]] = {}

    async def get(self, key: K, compute: Callable[[], Awaitable[V]]) -> V:
        now = self.clock.monotonic()
        hit = self._entries.get(key)
        if hit is not None and hit[0] > now:
            self.hits += 1
            return hit[1]
        pending = self._inflight.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        self.misses += 1
        fut: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            value = await compute()
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: waiters see it, nobody else must
            raise
        finally:
            del self._inflight[key]
        fut.set_result(value)
        self._entries[key] = (self.clock.monotonic() + self.ttl(value), value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return value


class KubeletAuth:
    """`token_webhook`: bearer tokens are reviewed (else they authenticate no one);
    `authorize_all`: the kubelet's AlwaysAllow mode, no SubjectAccessReview. The TTLs:
    how long answers are kept (a refused token at most TOKEN_REFUSED_TTL)."""

    def __init__(self, api: ServerApi, clock: Clock, *, anonymous: bool = False,
                 token_webhook: bool = True, authorize_all: bool = False,
                 token_ttl: float = TOKEN_TTL, allowed_ttl: float = ALLOWED_TTL,
                 denied_ttl: float = DENIED_TTL) -> None:
        self.api = api
        self.anonymous = anonymous
        self.token_webhook = token_webhook
        self.authorize_all = authorize_all
        refused_ttl = min(token_ttl, TOKEN_REFUSED_TTL)
        self.tokens: TtlCache[str, User | None] = TtlCache(
            clock, lambda u: token_ttl if u is not None else refused_ttl)
        self.reviews: TtlCache[str, tuple[bool, str]] = TtlCache(
            clock, lambda r: allowed_ttl if r[0] else denied_ttl)

    async def authenticate(self, authorization: str | None,
                           peercert: Mapping[str, Any] | None) -> User:
        if peercert:
            user = user_of_certificate(peercert)
            if user is not None:
                return user
        if authorization and self.token_webhook:
            scheme, _, token = authorization.partition(" ")
            token = token.strip()
            if scheme.lower() == "bearer" and token:
                key = hashlib.sha256(token.encode()).hexdigest()  # no token kept in memory
                found = await self.tokens.get(key, lambda: self._review_token(token))
                if found is None:
                    raise Unauthorized("the bearer token was not accepted")
                return found
        if self.anonymous:
            return User(ANONYMOUS, groups=(UNAUTHENTICATED,))
        raise Unauthorized("no client certificate and no bearer token")

    async def _review_token(self, token: str) -> User | None:
        try:
            status = await self.api.review_token(token)
        except Exception as e:  # noqa: BLE001 - the kubelet answers 401 and logs why
            log.warning("kubelet API: TokenReview failed: %s", e)
            raise Unauthorized(f"the token could not be reviewed: {e}") from e
        if not status.get("authenticated"):
            return None
        u = status.get("user") or {}
        extra = tuple(sorted((str(k), tuple(map(str, v or ())))
                             for k, v in (u.get("extra") or {}).items()))
        return User(str(u.get("username") or ""), str(u.get("uid") or ""),
                    tuple(map(str, u.get("groups") or ())), extra)

    async def authorize(self, user: User, method: str, path: str, node: str,
                        every_node_first: bool = False) -> None:
        """Raise Forbidden unless one of the request's subresources is allowed.
        `every_node_first` (a process of many nodes): ask first whether the user may
        on every Node (an empty name), which one cached review answers for all of them:
        metrics-server scraping a thousand virtual nodes costs one review, not one each."""
        if self.authorize_all:
            return
        verb, subresources = request_attributes(method, path)
        names = ["", node] if every_node_first and node else [node]
        for sub in subresources:
            for name in names:
                if await self._allowed(user, verb, sub, name):
                    return
        raise Forbidden(f"Forbidden (user={user.name}, verb={verb}, resource=nodes, "
                        f"subresource(s)=[{' '.join(subresources)}])")

    async def _allowed(self, user: User, verb: str, sub: str, node: str) -> bool:
        spec: dict[str, Any] = {
            "user": user.name, "groups": list(user.groups),
            "resourceAttributes": {"verb": verb, "group": "", "version": "v1",
                                   "resource": "nodes", "subresource": sub, "name": node}}
        if user.uid:
            spec["uid"] = user.uid
        if user.extra:
            spec["extra"] = {k: list(v) for k, v in user.extra}
        key = json.dumps(spec, sort_keys=True)
        allowed, _ = await self.reviews.get(key, functools.partial(self._review, spec))
        return bool(allowed)

    async def _review(self, spec: dict[str, Any]) -> tuple[bool, str]:
        try:
            status = await self.api.review_access(spec)
        except Exception as e:  # noqa: BLE001 - not cached; the next request asks again
            attrs = spec["resourceAttributes"]
            log.warning("kubelet API: SubjectAccessReview failed: %s", e)
            raise AuthorizationError(
                f"Authorization error (user={spec['user']}, verb={attrs['verb']}, "
                f"resource=nodes, subresource={attrs['subresource']})") from e
        return bool(status.get("allowed")) and not status.get("denied"), \
            str(status.get("reason") or "")

