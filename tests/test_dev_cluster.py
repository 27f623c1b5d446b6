"""nodepulse-dev's choices that need no cluster: the address nodes register at, and the
command line."""

from __future__ import annotations

import pytest

from nodepulse_dev.__main__ import build_parser
from nodepulse_dev.devcluster import pick_address


def link(name: str, *addresses: str) -> dict[str, object]:
    return {"ifname": name, "addr_info": [{"local": a} for a in addresses]}


def test_the_address_is_the_default_routes_interfaces_and_never_loopback() -> None:
    links = [link("lo", "127.0.0.1"), link("br0", "172.29.0.1"), link("eth0", "192.0.2.2"),
             link("dummy", "169.254.3.3")]
    assert pick_address(links, [{"dst": "default", "dev": "eth0"}]) == "192.0.2.2"
    # no default route: the first address the API server proxies to
    assert pick_address(links, []) == "172.29.0.1"
    with pytest.raises(RuntimeError, match="--node-ip"):
        pick_address([link("lo", "127.0.0.1"), link("eth0", "169.254.1.1")], [])


def test_the_command_line() -> None:
    args = build_parser().parse_args(["up", "--virtual-nodes", "1000", "--runtime", "cri"])
    assert (args.virtual_nodes, args.runtime, args.foreground) == (1000, "cri", False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--runtime", "docker"])
    assert build_parser().parse_args(["scale", "--virtual-nodes", "3"]).virtual_nodes == 3
