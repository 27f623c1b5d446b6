"""Raw JSON requests through an ApiClient built by nodeagent.api.client.

The generated methods turn bodies into models and back; the agent wants the API's JSON
as is (cheap to hash and compare, nothing dropped, cheaper when one process speaks for
many nodes), so requests go through the client's own serializer, authentication and
connection pool, and bodies are plain dicts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

Timeout = float | tuple[float, float] | None  # None: no timeout
SMP = "application/strategic-merge-patch+json"


def request(api: client.ApiClient, method: str, path: str, *,
            query: dict[str, Any] | None = None, body: Any = None,
            timeout: Timeout = 30.0, content_type: str = "application/json"
            ) -> urllib3.BaseHTTPResponse:
    """Send the request; return the unread urllib3 response (for streaming).
    Raises ApiException for a non-2xx status, like the generated methods."""
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = content_type
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
                 timeout: Timeout = 30.0, content_type: str = "application/json") -> Any:
    resp = request(api, method, path, query=query, body=body, timeout=timeout,
                   content_type=content_type)
    try:
        return json.loads(resp.data)
    finally:
        resp.release_conn()


def _q(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def json_lines(chunks: Iterator[bytes]) -> Iterator[list[Any]]:
    """A watch stream (one JSON object per line) as the objects of each chunk: the
    caller sees each batch as soon as its last line is complete."""
    buf = b""
    for chunk in chunks:
        buf += chunk
        if b"\n" not in chunk:
            continue
        *lines, buf = buf.split(b"\n")
        objs = [json.loads(line) for line in lines if line.strip()]
        if objs:
            yield objs
    if buf.strip():
        yield [json.loads(buf)]
