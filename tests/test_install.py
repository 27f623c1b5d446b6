"""Both programs import from a fresh, non-editable install, and the operator package
does not shadow the standard library's `operator`."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def fresh_install(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    tmp = tmp_path_factory.mktemp("install")
    wheels = tmp / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheels), str(ROOT)], check=True, cwd=tmp)
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    wheel = next(wheels.glob("nodepulse-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                    "--no-deps", "-q", str(wheel)], check=True, cwd=tmp)
    # Dependencies come from this environment's site-packages, put on PYTHONPATH: that
    # does not run its .pth files, so the editable checkout stays invisible.
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    return env_dir, env


def repo_modules() -> list[str]:
    names = []
    for pkg, folder in (("nodeagent", "nodeagent"), ("nodeoperator", "operator"),
                        ("nodepulse_dev", "nodepulse_dev")):
        names.append(pkg)
        for info in pkgutil.walk_packages([str(ROOT / folder)], prefix=pkg + "."):
            names.append(info.name)
    return names


def test_every_module_imports_from_the_wheel(fresh_install: tuple[Path, dict[str, str]]) -> None:
    env_dir, env = fresh_install
    modules = repo_modules()
    script = (
        "import importlib, operator, sys, sysconfig\n"
        "assert operator.__file__.startswith(sysconfig.get_paths()['stdlib']), operator.__file__\n"
        "assert hasattr(operator, 'itemgetter')\n"
        f"for name in {modules!r}:\n"
        "    m = importlib.import_module(name)\n"
        f"    assert m.__file__.startswith({str(env_dir)!r}), (name, m.__file__)\n"
        "print('imported', len(sys.modules))\n")
    out = subprocess.run([str(env_dir / "bin" / "python"), "-c", script], env=env,
                         capture_output=True, text=True, cwd=env_dir)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("imported")


@pytest.mark.parametrize("program", ["nodepulse-agent", "nodepulse-operator", "nodepulse-dev"])
def test_console_scripts_print_help(fresh_install: tuple[Path, dict[str, str]],
                                    program: str) -> None:
    env_dir, env = fresh_install
    out = subprocess.run([str(env_dir / "bin" / program), "--help"], env=env,
                         capture_output=True, text=True, cwd=env_dir)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: {program}")


# Heavy packages the agent imports only when a feature needs them, so a process of
# virtual nodes does not carry them: grpc (CRI runtime, grpc probes; 8.5 MB),
# cryptography (the kubelet API's TLS), the kubernetes client (15 MB: our own loader reads
# kubeconfigs, see nodeagent.api.client); ctypes (mounts) and inotify_simple (static pods).
LAZY = ("grpc", "cryptography", "kubernetes", "ctypes", "inotify_simple")
# and our own code that only some settings run: the host's cgroup drivers, static pods'
# sources and their mirror pods, graceful node shutdown
LAZY_OURS = ("nodeagent.pods.cgroupfs", "nodeagent.pods.systemdcgroups",
             "nodeagent.pods.sources.file", "nodeagent.pods.sources.http",
             "nodeagent.pods.sources.static", "nodeagent.pods.sources.mirror",
             "nodeagent.shutdown", "nodeagent.systembus")


def test_the_agent_imports_heavy_packages_only_when_used() -> None:
    script = ("import sys, nodeagent.cli, nodeagent.agent, nodeagent.runtime.fake\n"
              f"print(sorted(({{m.split('.')[0] for m in sys.modules}} & {set(LAZY)!r})\n"
              f"             | (set(sys.modules) & {set(LAZY_OURS)!r})))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout
