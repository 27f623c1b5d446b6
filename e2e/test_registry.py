"""The image registry fixture (nodepulse_dev/registry.py) is a real one: an image pushed
to it by crane is pulled by a containerd through CRI PullImage only with the right
credentials and only when containerd trusts the registry's CA (its certs.d names it).

The containerd here starts empty (no images imported), so the pulled image can only
have come from the registry; its digest is the one crane pushed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from nodeagent.runtime.cri.gen import api_pb2 as pb
from nodeagent.runtime.cri.gen import api_pb2_grpc as pb_grpc
from nodepulse_dev import images, pki
from nodepulse_dev.containerd import Containerd, start_containerd
from nodepulse_dev.registry import Registry


@pytest.fixture
def empty_containerd() -> Iterator[Containerd]:
    ctd = start_containerd(cni=False, import_images=False)
    try:
        yield ctd
    finally:
        ctd.stop()


def pull(ctd: Containerd, image: str, auth: tuple[str, str] | None = None) -> str:
    req = pb.PullImageRequest(image=pb.ImageSpec(image=image))
    if auth:
        req.auth.CopyFrom(pb.AuthConfig(username=auth[0], password=auth[1]))
    with ctd.channel() as ch:
        return str(pb_grpc.ImageServiceStub(ch).PullImage(req, timeout=60).image_ref)


def refused(ctd: Containerd, image: str, auth: tuple[str, str] | None = None) -> str:
    with pytest.raises(grpc.RpcError) as err:
        pull(ctd, image, auth)
    return str(err.value.details())


def test_a_pushed_image_is_pulled_with_credentials_and_refused_without(
        registry: Registry, empty_containerd: Containerd, tmp_path: Path) -> None:
    ctd = empty_containerd
    pushed = registry.push(images.build_busybox_tar(), "e2e/busybox:pushed")
    image = f"{registry.host}/e2e/busybox:pushed"
    assert pushed == f"{registry.host}/e2e/busybox@{registry.digest('e2e/busybox:pushed')}"

    # TLS is checked: with another CA named for the host, the pull is refused
    other = pki.CertificateAuthority(tmp_path / "other-ca")
    ctd.trust_registry(registry.host, other.cert_path)
    assert "x509: certificate signed by unknown authority" in refused(ctd, image, registry.auth)
    ctd.trust_registry(registry.host, registry.ca)

    assert "401 Unauthorized" in refused(ctd, image)
    assert "401 Unauthorized" in refused(ctd, image, (registry.username, "not-the-password"))
    with ctd.channel() as ch:
        assert not pb_grpc.ImageServiceStub(ch).ImageStatus(
            pb.ImageStatusRequest(image=pb.ImageSpec(image=image)), timeout=10).HasField("image")

    ref = pull(ctd, image, registry.auth)
    with ctd.channel() as ch:
        status = pb_grpc.ImageServiceStub(ch).ImageStatus(
            pb.ImageStatusRequest(image=pb.ImageSpec(image=image)), timeout=10)
    assert status.image.id == ref
    assert image in status.image.repo_tags
    assert pushed in status.image.repo_digests
