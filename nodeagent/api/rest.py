"""Raw JSON requests through an ApiClient built by nodeagent.api.client.

The generated methods turn bodies into pydantic models and back; for pods we want the
API's JSON as is (cheap to hash, nothing dropped), so requests go through the client's
own serializer, authentication and connection pool, and bodies are plain dicts.
"""

from __future__ import annotations

import json
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

Timeout = float | tuple[float, float]


def request(api: client.ApiClient, method: str, path: str, *,
            query: dict[str, Any] | None = None, body: Any = None,
            timeout: Timeout = 30.0) -> urllib3.BaseHTTPResponse:
    """Send the request; return the unread urllib3 response (for streaming).
    Raises ApiException for a non-2xx status, like the generated methods."""
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    params = [(k, _q(v)) for k, v in (query or {}).items() if v is not None]
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
                 timeout: Timeout = 30.0) -> Any:
    resp = request(api, method, path, query=query, body=body, timeout=timeout)
    try:
        return json.loads(resp.data)
    finally:
        resp.release_conn()


def _q(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)
