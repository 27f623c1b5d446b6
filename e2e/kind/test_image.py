"""The image, built by the Dockerfile (e2e/kind/images.py): what the chart relies on.

It runs as user 10001 with a read-only root filesystem, both programs start, their
code is byte-compiled at build time (nothing to write at run time), and nothing of the
build stage (sources, wheels) is left in it.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from e2e.kind.docker import Dockerd
from e2e.kind.images import REPO, build_context

# The first test to use the engine or the cluster also waits for what is not cached yet
# (Go builds, debootstrap, the image builds: about 10 minutes cold, e2e/kind/conftest.py).
pytestmark = pytest.mark.timeout(1800)


def run(engine: Dockerd, image: str, script: str) -> str:
    """`sh -c script` in a container of `image` as the chart runs it: read-only root
    filesystem, the image's own user, no capabilities."""
    return engine.docker("run", "--rm", "--read-only", "--cap-drop=ALL",
                         "--security-opt=no-new-privileges", "--network=none",
                         image, "sh", "-c", script).stdout


def test_the_build_context_is_what_the_dockerfile_copies() -> None:
    """The Dockerfile copies exactly what .dockerignore lets into the build: what the
    wheel is built from (pyproject.toml, the README it names, each package's folder)."""
    copied = {src.rstrip("/") for line in (REPO / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY ") for src in line.split()[1:-1]}
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {setuptools["package-dir"].get(p, p) for p in setuptools["packages"]
               if "." not in p}
    assert copied == {"pyproject.toml", "README.md", *folders}
    sent = {str(p.relative_to(REPO)).split("/")[0] for p in build_context()}
    assert sent == copied | {"Dockerfile", ".dockerignore"}


def test_image_runs_as_10001_with_a_read_only_root(engine: Dockerd, project_image: str) -> None:
    (config,) = json.loads(engine.docker("image", "inspect", project_image).stdout)
    assert config["Config"]["User"] == "10001:10001"
    assert config["Config"]["Cmd"] == ["nodepulse-operator"]
    out = run(engine, project_image,
              "id -u; id -g; touch /probe 2>&1 || true; touch /tmp/probe 2>&1 || true")
    uid, gid, *errors = out.splitlines()
    assert (uid, gid) == ("10001", "10001")
    assert errors == ["touch: cannot touch '/probe': Read-only file system",
                      "touch: cannot touch '/tmp/probe': Read-only file system"]


def test_both_programs_start(engine: Dockerd, project_image: str) -> None:
    out = run(engine, project_image, "nodepulse-operator --version; nodepulse-agent --version")
    assert out.split() == ["nodepulse-operator", "0.1.0", "nodepulse-agent", "0.1.0"], out


def test_code_is_compiled_and_the_build_stage_left_nothing(engine: Dockerd,
                                                           project_image: str) -> None:
    script = """
        site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        echo "$site"
        ls "$site/nodeagent/__pycache__" | grep -c '\\.pyc$'
        ls "$site/nodeoperator/__pycache__" | grep -c '\\.pyc$'
        ls -A /wheels 2>/dev/null | wc -l
        test -e /src && echo src || echo no-src
        python -c 'import nodeoperator.app, nodeagent.agent; print("imported")'
    """
    site, agent_pyc, operator_pyc, wheels, src, imported = run(
        engine, project_image, script).split()
    # compiled at build time: with a read-only root Python could not write them later
    package = Path(__file__).resolve().parent.parent.parent
    assert int(agent_pyc) == len(list((package / "nodeagent").glob("*.py")))
    assert int(operator_pyc) == len(list((package / "operator").glob("*.py")))
    assert site.startswith("/usr/")
    assert (wheels, src, imported) == ("0", "no-src", "imported")
