"""The operator's command line and its conversion of our client configuration into
kopf's ConnectionInfo (no cluster needed: kubeconfigs are written to a temp dir)."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from nodeoperator import cli
from nodeoperator.app import connection_info


def kubeconfig(tmp: Path, user: dict[str, str]) -> Path:
    path = tmp / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {
            "server": "https://127.0.0.1:6443",
            "certificate-authority-data": base64.b64encode(b"CA PEM").decode()}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    return path


def test_help_runs_as_the_console_script() -> None:
    out = subprocess.run([str(Path(sys.executable).parent / "nodepulse-operator"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "--kubeconfig" in out.stdout and "--leader-election-namespace" in out.stdout


def test_bad_leader_timings_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--leader-lease-duration", "5", "--leader-renew-deadline", "10"]) == 2
    assert "--leader-renew-deadline" in capsys.readouterr().err


def test_writers_below_one_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--writers", "0"]) == 2
    assert "--writers must be at least 1, got 0" in capsys.readouterr().err


def test_missing_kubeconfig_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    assert cli.main(["--kubeconfig", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err


def test_connection_info_with_client_certificate(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path, {
        "client-certificate-data": base64.b64encode(b"CERT").decode(),
        "client-key-data": base64.b64encode(b"KEY").decode()})
    info = connection_info(str(path), None)
    assert info.server == "https://127.0.0.1:6443"
    assert (info.ca_data, info.certificate_data, info.private_key_data) == (
        b"CA PEM", b"CERT", b"KEY")
    assert info.token is None and not info.insecure


def test_connection_info_with_token(tmp_path: Path) -> None:
    info = connection_info(str(kubeconfig(tmp_path, {"token": "s3cret"})), None)
    assert info.scheme == "Bearer" and info.token == "s3cret"
    assert info.certificate_path is None


def test_kopf_runs_clusterwide_and_standalone(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """clusterwide: kopf never lists Namespaces (the chart grants none); standalone: no
    kopf peering objects (the chart ships no peering CRDs; the Lease election is the
    HA). kopf.operator is replaced, so nothing is contacted."""
    import asyncio

    import kopf
    from nodeoperator import app

    seen: dict[str, object] = {}

    async def fake_operator(**kwargs: object) -> None:
        seen.update(kwargs)

    monkeypatch.setattr(kopf, "operator", fake_operator)
    path = kubeconfig(tmp_path, {"token": "t"})
    asyncio.run(app.run(app.Options(kubeconfig=str(path))))
    assert seen["clusterwide"] is True and seen["standalone"] is True
    assert not seen.get("namespaces")
    settings = seen["settings"]
    assert isinstance(settings, kopf.OperatorSettings)
    assert settings.posting.enabled is False  # kopf's own Events off: ours are the monitor's


def test_node_lifecycle_mode_and_cluster_grace(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """coexist unless told otherwise (the safe choice on a cluster whose controller
    manager runs its node-lifecycle controller); the grace as the controller manager's
    flag spells it."""
    from nodeoperator import app

    seen: list[app.Options] = []

    async def fake_run(opts: app.Options) -> None:
        seen.append(opts)

    monkeypatch.setattr(app, "run", fake_run)
    assert cli.main([]) == 0
    assert seen[-1].lifecycle.mode == "coexist" and seen[-1].lifecycle.cluster_grace == 50
    assert cli.main(["--node-lifecycle", "exclusive"]) == 0
    assert seen[-1].lifecycle.exclusive
    assert cli.main(["--node-monitor-grace-period", "1m30s"]) == 0
    assert seen[-1].lifecycle.cluster_grace == 90
    assert cli.main(["--node-monitor-grace-period", "soon"]) == 2
    assert "--node-monitor-grace-period: not a duration: 'soon'" in capsys.readouterr().err
    assert cli.main(["--node-monitor-grace-period", "0s"]) == 2
    with pytest.raises(SystemExit):
        cli.main(["--node-lifecycle", "both"])
    assert "invalid choice: 'both'" in capsys.readouterr().err
