"""The layering rules the code keeps (docs: the architecture page), read from the import
statements of every module of the two programs, those inside functions and under
TYPE_CHECKING included:

- the operator imports nothing of the agent but nodeagent.api;
- nodeagent.api imports nothing else of the project;
- nothing above nodeagent/runtime/ imports a concrete runtime (the composition root
  names one through nodeagent.runtime.make_runtime);
- the pod half (nodeagent.pods) and the heartbeat half (nodeagent.node) do not import
  each other, and neither imports the kubelet API's server;
- graceful node shutdown (nodeagent.shutdown) imports neither half: the composition
  root hands it what it uses of both;
- only nodeagent.systembus speaks D-Bus (imports dbus_fast);
- neither program imports the local cluster (nodepulse_dev), nor the tests: the cluster
  drives the programs, not the other way round.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONCRETE_RUNTIMES = ("nodeagent.runtime.cri", "nodeagent.runtime.process",
                     "nodeagent.runtime.fake", "nodeagent.runtime.execserver")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "operator":
        parts[0] = "nodeoperator"
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(source: str, module: str, is_package: bool = False) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import in `source`, relative ones resolved
    against `module`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")
                if not is_package:
                    package = package[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            # `from pkg import mod` may import a module: count both names
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def violations(module: str, imported: str) -> list[str]:
    """The rules `module` breaks by importing `imported`."""
    out = []
    if within(module, "nodeoperator") and within(imported, "nodeagent") \
            and not within(imported, "nodeagent.api"):
        out.append("the operator imports only nodeagent.api of the agent")
    if within(module, "nodeagent.api") and (within(imported, "nodeoperator") or (
            within(imported, "nodeagent") and not within(imported, "nodeagent.api")
            and imported != "nodeagent")):
        out.append("nodeagent.api imports nothing else of the project")
    if within(module, "nodeagent") and not within(module, "nodeagent.runtime") \
            and any(within(imported, r) for r in CONCRETE_RUNTIMES):
        out.append("nothing above nodeagent/runtime/ imports a concrete runtime")
    for half, other in (("nodeagent.pods", "nodeagent.node"),
                        ("nodeagent.node", "nodeagent.pods")):
        if within(module, half) and within(imported, other):
            out.append(f"{half} does not import {other}")
        if within(module, half) and within(imported, "nodeagent.server"):
            out.append(f"{half} does not import the kubelet API's server")
        if within(module, "nodeagent.shutdown") and within(imported, half):
            out.append(f"nodeagent.shutdown does not import {half}: the root hands it in")
    if within(imported, "dbus_fast") and module != "nodeagent.systembus":
        out.append("only nodeagent.systembus speaks D-Bus")
    if (within(module, "nodeagent") or within(module, "nodeoperator")) and any(
            within(imported, p) for p in ("nodepulse_dev", "e2e", "tests", "bench")):
        out.append("the programs do not import the local cluster or the tests")
    return out


def program_modules() -> Iterator[tuple[Path, str]]:
    for top in ("nodeagent", "operator"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "gen" in path.relative_to(ROOT).parts:
                continue  # the CRI stubs, generated
            yield path, module_name(path)


def test_the_layering_rules_hold() -> None:
    broken = []
    checked = 0
    for path, module in program_modules():
        checked += 1
        for line, imported in imports(path.read_text(), module, path.name == "__init__.py"):
            broken += [f"{path.relative_to(ROOT)}:{line}: imports {imported}: {rule}"
                       for rule in violations(module, imported)]
    assert checked > 100  # the whole tree was read
    assert not broken, "\n".join(broken)


def test_each_rule_names_what_breaks_it() -> None:
    """The check catches what it is for (else a rule could be read and never fail)."""
    cases = {
        ("nodeoperator.monitor", "nodeagent.pods.syncer"): "the operator imports only",
        ("nodeagent.api.kube", "nodeagent.config"): "nodeagent.api imports nothing else",
        ("nodeagent.pods.syncer", "nodeagent.runtime.cri.criruntime"): "a concrete runtime",
        ("nodeagent.server.stats", "nodeagent.runtime.fake"): "a concrete runtime",
        ("nodeagent.pods.loops", "nodeagent.node.status"): "nodeagent.pods does not import",
        ("nodeagent.node.status", "nodeagent.pods.images"): "nodeagent.node does not import",
        ("nodeagent.pods.hooks", "nodeagent.server.containerlogs"): "the kubelet API's server",
        ("nodeagent.shutdown", "nodeagent.pods.podhalf"): "shutdown does not import",
        ("nodeagent.shutdown", "nodeagent.node.controller"): "shutdown does not import",
        ("nodeagent.agent", "dbus_fast.aio"): "only nodeagent.systembus speaks D-Bus",
        ("nodeagent.agent", "nodepulse_dev.cluster"): "the local cluster",
        ("nodeoperator.cli", "nodepulse_dev"): "the local cluster",
        ("nodeagent.server.stats", "e2e.harness.ports"): "the local cluster",
    }
    for (module, imported), rule in cases.items():
        assert any(rule in v for v in violations(module, imported)), (module, imported)
    # allowed: the same names the other way, or within a layer
    for module, imported in (("nodeoperator.writes", "nodeagent.api.kube"),
                             ("nodeagent.agent", "nodeagent.runtime"),
                             ("nodeagent.runtime.process", "nodeagent.runtime.execserver"),
                             ("nodeagent.server.kubeletserver", "nodeagent.api.clock"),
                             ("nodeagent.systembus", "dbus_fast.aio"),
                             ("nodeagent.agent", "nodeagent.shutdown"),
                             ("nodepulse_dev.cluster", "nodeagent.api.client")):
        assert violations(module, imported) == [], (module, imported)


def test_relative_and_lazy_imports_are_read() -> None:
    source = ("def f():\n    from nodeagent.pods import syncer\n"
              "from . import kube\nfrom .clock import Clock\n")
    found = list(imports(source, "nodeagent.api.rest"))
    assert (2, "nodeagent.pods.syncer") in found
    assert (3, "nodeagent.api.kube") in found and (4, "nodeagent.api.clock") in found
