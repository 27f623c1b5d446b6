"""bench.pernode runs on the in-memory API and says what a node holds."""

from __future__ import annotations

import pytest

from bench import pernode


def test_it_prints_the_bytes_per_node_and_the_lines_that_hold_them(
        capsys: pytest.CaptureFixture[str]) -> None:
    pernode.main(["--nodes", "3", "--minutes", "0.2", "--top", "40"])
    out = capsys.readouterr().out
    assert "3 idle virtual nodes" in out and "B per node" in out
    assert "nodeagent/node/" in out  # the heartbeat half's own objects are among them
    assert "fakekube" not in out     # the in-memory API's are not
