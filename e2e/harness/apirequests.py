"""Plain blocking API requests over the kubernetes client, for paths its generated
methods do not cover (or cover without streaming)."""

from __future__ import annotations

import json
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException


def request(api: client.ApiClient, method: str, path: str, *,
            query: dict[str, Any] | None = None, body: Any = None,
            timeout: float | tuple[float, float] = 30.0) -> urllib3.BaseHTTPResponse:
    """Send the request; return the unread urllib3 response (for streaming).
    Raises ApiException for a non-2xx status, like the generated methods."""
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    params = [(k, str(v).lower() if isinstance(v, bool) else str(v))
              for k, v in (query or {}).items() if v is not None]
    m, url, hdrs, data, post = api.param_serialize(
        method, path, query_params=params, header_params=headers, body=body,
        auth_settings=["BearerToken"])
    resp = api.call_api(m, url, hdrs, data, post, _request_timeout=timeout)
    if not 200 <= resp.status <= 299:
        resp.read()
        raise ApiException.from_response(http_resp=resp, body=None, data=None)
    return resp.response


def request_json(api: client.ApiClient, method: str, path: str, *,
                 query: dict[str, Any] | None = None, body: Any = None,
                 timeout: float = 30.0) -> Any:
    """The answer's JSON (the connection goes back to the pool)."""
    resp = request(api, method, path, query=query, body=body, timeout=timeout)
    try:
        return json.loads(resp.data)
    finally:
        resp.release_conn()
