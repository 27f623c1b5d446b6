"""Credentials from a kubeconfig or the in-cluster service account (our own loader: the
agent and operator never import the kubernetes client package), and the kubernetes
client that tests and scripts get with the same credentials."""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from nodeagent.api.client import (
    ClientConfigError,
    from_kubeconfig,
    in_cluster,
    load_credentials,
    new_api_client,
)


def kubeconfig(tmp_path: Path, user: dict[str, Any] | None = None,
               cluster: dict[str, Any] | None = None, name: str = "kubeconfig") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": cluster or {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": user if user is not None else {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}},
                     {"name": "other", "context": {"cluster": "k"}}]}))
    return path


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_token_and_server_from_the_current_context(tmp_path: Path) -> None:
    creds = load_credentials(kubeconfig(tmp_path))
    assert creds.server == "https://127.0.0.1:1"
    assert creds.authorization() == "Bearer t"
    assert from_kubeconfig(kubeconfig(tmp_path), "other").authorization() is None


def test_files_are_relative_to_the_kubeconfig_and_data_is_decoded(tmp_path: Path) -> None:
    (tmp_path / "pki").mkdir()
    creds = load_credentials(kubeconfig(
        tmp_path, {"client-certificate": "pki/c.crt", "client-key": "/abs/c.key"},
        {"server": "https://h:6443/", "certificate-authority-data":
         base64.b64encode(b"CA").decode(), "tls-server-name": "api", "proxy-url": "http://p:3",
         "insecure-skip-tls-verify": True}))
    assert creds.server == "https://h:6443"
    assert creds.cert_file == str(tmp_path / "pki" / "c.crt") and creds.key_file == "/abs/c.key"
    assert creds.ca_data == b"CA" and creds.file_of("ca") is not None
    assert Path(str(creds.file_of("ca"))).read_bytes() == b"CA"
    assert stat.S_IMODE(os.stat(str(creds.file_of("ca"))).st_mode) == 0o600
    assert (creds.tls_server_name, creds.proxy, creds.insecure) == ("api", "http://p:3", True)


def test_basic_auth(tmp_path: Path) -> None:
    creds = load_credentials(kubeconfig(tmp_path, {"username": "a", "password": "b"}))
    assert creds.authorization() == "Basic " + base64.b64encode(b"a:b").decode()


def test_a_token_file_is_read_again_every_minute(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("one\n")
    clock = Clock()
    creds = from_kubeconfig(kubeconfig(tmp_path, {"tokenFile": "token"}))
    creds._clock = clock  # a fake clock: no sleeping
    assert creds.authorization() == "Bearer one"
    token.write_text("two")
    clock.t = 59
    assert creds.authorization() == "Bearer one"
    clock.t = 61
    assert creds.authorization() == "Bearer two"
    token.unlink()  # a rotation in progress: the last token stays
    clock.t = 200
    assert creds.authorization() == "Bearer two"


def test_an_exec_plugin_is_run_again_once_its_token_expires(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    expires = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    plugin = tmp_path / "plugin.py"
    plugin.write_text(f"""import json, os, sys
info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
with open({str(runs)!r}, "a") as f:
    f.write(info["kind"] + " " + sys.argv[0] + " " + os.environ["EXTRA"] + "\\n")
n = len(open({str(runs)!r}).read().splitlines())
print(json.dumps({{"apiVersion": info["apiVersion"], "kind": "ExecCredential",
                  "status": {{"token": f"tok{{n}}", "expirationTimestamp": "{expires}"}}}}))
""")
    creds = from_kubeconfig(kubeconfig(tmp_path, {"exec": {
        "apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable,
        "args": [str(plugin)], "env": [{"name": "EXTRA", "value": "x"}]}}))
    clock = Clock()
    creds._clock = clock
    creds._token_until = 3600 - 10  # as the first run planned it, on the fake clock
    assert creds.authorization() == "Bearer tok1"
    clock.t = 3000
    assert creds.authorization() == "Bearer tok1"
    clock.t = 3600
    assert creds.authorization() == "Bearer tok2"
    assert runs.read_text().splitlines() == [f"ExecCredential {plugin} x"] * 2


def test_bad_kubeconfigs_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ClientConfigError, match="nope: no such file"):
        load_credentials(tmp_path / "nope")
    with pytest.raises(ClientConfigError, match="no context named 'missing'"):
        load_credentials(kubeconfig(tmp_path), "missing")
    with pytest.raises(ClientConfigError, match="auth-provider 'oidc'.*exec credential plugin"):
        load_credentials(kubeconfig(tmp_path, {"auth-provider": {"name": "oidc"}}))
    with pytest.raises(ClientConfigError, match="cluster 'k' has no server"):
        load_credentials(kubeconfig(tmp_path, cluster={"insecure-skip-tls-verify": True}))
    with pytest.raises(ClientConfigError, match="client-key-data is not base64"):
        load_credentials(kubeconfig(tmp_path, {"client-key-data": "@@@"}))
    failing = tmp_path / "fail.sh"
    failing.write_text("#!/bin/sh\necho denied >&2\nexit 3\n")
    failing.chmod(0o755)
    with pytest.raises(ClientConfigError, match="exited 3: denied"):
        load_credentials(kubeconfig(tmp_path, {"exec": {"command": str(failing)}}))


def test_in_cluster_service_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "token").write_text("sa-token")
    (tmp_path / "ca.crt").write_text("CA")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    creds = in_cluster(tmp_path)
    assert creds.server == "https://[fd00::1]:443"
    assert creds.authorization() == "Bearer sa-token" and creds.ca_file == str(tmp_path / "ca.crt")
    (tmp_path / "token").unlink()
    with pytest.raises(ClientConfigError, match="token does not exist"):
        in_cluster(tmp_path)


def test_the_kubernetes_client_gets_the_same_credentials(tmp_path: Path) -> None:
    api = new_api_client(kubeconfig(tmp_path), component="agent", pool_size=7, retries=0)
    cfg = api.configuration
    assert cfg.host == "https://127.0.0.1:1"
    assert cfg.retries == 0 and cfg.connection_pool_maxsize == 7
    assert api.user_agent == "nodepulse/agent"
    assert cfg.get_api_key_with_prefix("authorization") == "Bearer t"


def test_an_expired_plugin_token_is_refused_early(tmp_path: Path) -> None:
    plugin = tmp_path / "p.sh"
    plugin.write_text("#!/bin/sh\necho '" + json.dumps(
        {"kind": "ExecCredential", "status": {"token": "x", "expirationTimestamp": "soon"}})
        + "'\n")
    plugin.chmod(0o755)
    with pytest.raises(ClientConfigError, match="expirationTimestamp 'soon'"):
        load_credentials(kubeconfig(tmp_path, {"exec": {"command": str(plugin)}}))
