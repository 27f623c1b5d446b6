"""The one place that builds Kubernetes API clients, and the shared retry policy.

Everything else in nodepulse is handed an ApiClient built here.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

USER_AGENT = "nodepulse"


class ClientConfigError(Exception):
    """No usable credentials: names where it looked."""


def load_configuration(kubeconfig: str | os.PathLike[str] | None = None,
                       context: str | None = None) -> client.Configuration:
    """Credentials from, in order: the given kubeconfig, $KUBECONFIG, the in-cluster
    service account, ~/.kube/config."""
    cfg = client.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path:
        if not Path(path).is_file():
            raise ClientConfigError(f"kubeconfig {path!s}: no such file")
        config.load_kube_config(config_file=str(path), context=context,
                                client_configuration=cfg)
        return cfg
    try:
        config.load_incluster_config(client_configuration=cfg)
        return cfg
    except ConfigException:
        pass
    default = Path.home() / ".kube" / "config"
    if default.is_file():
        config.load_kube_config(config_file=str(default), context=context,
                                client_configuration=cfg)
        return cfg
    raise ClientConfigError(
        "no kubeconfig given (--kubeconfig or $KUBECONFIG), not running in a pod, "
        f"and {default} does not exist")


def new_api_client(kubeconfig: str | os.PathLike[str] | None = None,
                   context: str | None = None, *, component: str = "nodepulse",
                   pool_size: int = 16, retries: int | None = None) -> client.ApiClient:
    """An ApiClient whose connection pool allows `pool_size` concurrent requests.

    `retries=0` turns off urllib3's own re-sending, for callers that retry with their
    own deadlines (a Lease write must not be re-sent past the lease's expiry)."""
    cfg = load_configuration(kubeconfig, context)
    cfg.connection_pool_maxsize = pool_size
    if retries is not None:
        cfg.retries = retries
    api = client.ApiClient(cfg)
    api.user_agent = f"{USER_AGENT}/{component}"
    return api


def status_of(exc: BaseException) -> int | None:
    """The HTTP status of an API error, or None for transport errors."""
    return exc.status if isinstance(exc, ApiException) else None


def is_retriable(exc: BaseException) -> bool:
    """Worth trying again: the server is busy or unreachable, not refusing the request."""
    if isinstance(exc, ApiException):
        return exc.status in (0, 429, 500, 502, 503, 504)
    return isinstance(exc, (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError))


def brief(exc: BaseException) -> str:
    """How a log line or an Event names an error: "HTTP 404 NotFound: <the Status
    message>" for the API server's answers, "<type>: <text>" for the rest."""
    if isinstance(exc, ApiException):
        message = ""
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            message = str(json.loads(exc.body or b"{}").get("message") or "")
        text = f"HTTP {exc.status} {exc.reason}"
        return f"{text}: {message}" if message and message != exc.reason else text
    return f"{type(exc).__name__}: {exc}"
