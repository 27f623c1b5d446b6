from pathlib import Path

import pytest
import yaml

from nodeagent.api.client import ClientConfigError, new_api_client


def kubeconfig(tmp_path: Path) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    return path


def test_client_from_kubeconfig(tmp_path: Path) -> None:
    api = new_api_client(kubeconfig(tmp_path), component="agent", pool_size=7, retries=0)
    assert api.configuration.host == "https://127.0.0.1:1"
    assert api.configuration.retries == 0
    assert api.configuration.connection_pool_maxsize == 7
    assert api.user_agent == "nodepulse/agent"


def test_missing_kubeconfig_is_named(tmp_path: Path) -> None:
    with pytest.raises(ClientConfigError, match="nope: no such file"):
        new_api_client(tmp_path / "nope")
