"""The upstream [Conformance] suite on a kind cluster, as hydrophone or sonobuoy run it
(`e2e.test --ginkgo.focus='\\[Conformance\\]'`, the [Serial] specs alone), with the node
agent of every node, control plane included, either nodepulse (e2e/kind/agent_node.py)
or the kubelet (e2e/kind/node.py): the same cluster shape, one control-plane node and
two workers, the same node image but for the agent.

    with kind_cluster("nodepulse", workdir) as cluster:   # private dockerd, nodes Ready
        results, wall = run.run_all(plan, run.Target(cluster.kubeconfig), workdir)

The cluster lives on a private Docker engine (e2e/kind/docker.py), which is stopped by
PID at the end with everything it ran; the host's kernel tunables are restored if a
node changed one. Every image the specs name is built here
(e2e/conformance/images.py) and imported into every node's containerd before the run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import subprocess
import tarfile
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

import yaml

from e2e.conformance import images, run
from e2e.kind import agent_node, node
from e2e.kind.cluster import HostSysctls, KindCluster
from e2e.kind.docker import host_links, host_rules, start_dockerd

CONFIG = Path(__file__).with_name("kind-config.yaml")
PLAN = Path(__file__).with_name("conformance.yaml")
RESULTS = Path(__file__).with_name("results")
AGENTS = ("nodepulse", "kubelet")


def node_image(agent: str) -> str:
    if agent not in AGENTS:
        raise ValueError(f"node agent {agent!r}: expected one of {', '.join(AGENTS)}")
    return agent_node.image_name() if agent == "nodepulse" else node.image_name()


def cluster_config(agent: str, out: Path) -> Path:
    """CONFIG with every node on the agent's node image, named after the agent."""
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["name"] = f"{cfg['name']}-{agent}"
    for n in cfg["nodes"]:
        n["image"] = node_image(agent)
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def _oci_ref(tar: Path) -> str:
    """The tag an OCI tar's index records (what `ctr import --base-name` names it)."""
    with tarfile.open(tar) as t:
        f = t.extractfile("index.json")
        assert f is not None
        index = json.load(f)
    return str(index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"])


def load_images(cluster: KindCluster, tars: dict[str, Path]) -> None:
    """Import each OCI tar into every node's containerd under its name, the nodes at
    the same time."""
    with concurrent.futures.ThreadPoolExecutor() as pool:
        for done in [pool.submit(_load_node_images, cluster, name, tars)
                     for name in cluster.nodes()]:
            done.result()


def _load_node_images(cluster: KindCluster, name: str, tars: dict[str, Path]) -> None:
    for image, tar in tars.items():
        repo, tag = image.rsplit(":", 1)
        ctr = ["ctr", "-n", "k8s.io", "images"]
        with open(tar, "rb") as f:
            proc = subprocess.run(["docker", "exec", "-i", name, *ctr, "import",
                                   "--base-name", repo, "-"], stdin=f, capture_output=True,
                                  text=True, timeout=600, env=cluster.engine.env())
        if proc.returncode != 0:
            raise RuntimeError(f"{name}: importing {tar} as {image} failed: {proc.stderr}")
        ref = _oci_ref(tar)
        if ref != tag:  # this project's own images record their own tag
            cluster.node_exec(name, *ctr, "tag", "--force", f"{repo}:{ref}", image)
            cluster.node_exec(name, *ctr, "rm", f"{repo}:{ref}")


@contextlib.contextmanager
def kind_cluster(agent: str, workdir: Path, log: Callable[[str], None] = print,
                 keep_logs: bool = False) -> Iterator[KindCluster]:
    """A kind cluster whose nodes run `agent`, with the specs' images, on a private
    Docker engine; deleted, and the engine stopped, when the block ends."""
    workdir.mkdir(parents=True, exist_ok=True)
    tars = images.conformance_images()  # before anything runs: a build takes a while
    config = cluster_config(agent, workdir / "kind-config.yaml")
    with private_kind_cluster(config, (agent,), workdir, tars, log, keep_logs) as cluster:
        yield cluster


@contextlib.contextmanager
def private_kind_cluster(config: Path, agents: tuple[str, ...], workdir: Path,
                         tars: dict[str, Path], log: Callable[[str], None] = print,
                         keep_logs: bool = False) -> Iterator[KindCluster]:
    """The kind cluster of `config`, whose nodes run the node images of `agents`, with
    the image `tars` imported into every node, on a private Docker engine; deleted, and
    the engine stopped, when the block ends. Then raises if the engine left a process,
    a link or an iptables rule on the host (a kernel tunable a node changed is restored
    and said)."""
    links, rules = host_links(), host_rules()
    children: list[int] = []
    with HostSysctls() as sysctls, start_dockerd() as engine:
        for agent in agents:
            started = time.monotonic()
            if agent == "nodepulse":
                agent_node.load_agent_node_image(engine, log)
            else:
                node.load_node_image(engine, log)
            log(f"{node_image(agent)} in the engine: {time.monotonic() - started:.0f} s")
        cluster = KindCluster.create(engine, workdir, log, config,
                                     tuple(node_image(a) for a in agents))
        try:
            started = time.monotonic()
            load_images(cluster, tars)
            log(f"{len(tars)} images in every node: {time.monotonic() - started:.0f} s")
            yield cluster
        finally:
            if keep_logs:
                cluster.save_logs()
            cluster.delete()
            children = engine.child_pids()  # what must be gone once the engine stops
    if sysctls.changed:
        log(f"host kernel tunables a node changed, restored: {sysctls.changed}")
    left = [f"process {pid}" for pid in children if Path(f"/proc/{pid}").exists()]
    left += [f"link {link}" for link in host_links() - links]
    # (other tests on the machine may add rules of their own meanwhile: Docker's only)
    left += [f"iptables rule {r!r}" for r in set(host_rules()) - set(rules)
             if "docker" in r.lower()]
    if left:
        raise RuntimeError(f"the Docker engine of the kind cluster left: {', '.join(left)}")


def measure(agent: str, workdir: Path, plan: run.Plan, only: str | None = None,
            names: Collection[str] | None = None, log: Callable[[str], None] = print,
            keep_logs: bool = False,
            progress: Callable[[list[run.Result], float], None] | None = None,
            ) -> tuple[list[run.Result], float]:
    """The plan's specs against a kind cluster of `agent` nodes."""
    from nodepulse_dev import build

    build.ensure(["e2e.test", "kubectl"], log=log)  # before anything runs
    with kind_cluster(agent, workdir, log, keep_logs) as cluster:
        return run.run_all(plan, run.Target(cluster.kubeconfig), workdir, only, log, names,
                           progress)


def column_file(agent: str) -> Path:
    return RESULTS / f"conformance-kind-{agent}.json"


def save_column(agent: str, results: list[run.Result], wall: float, command: str,
                partial: bool, path: Path | None = None) -> Path:
    """One column of the doc's table: a run's results with what it was, as JSON."""
    path = path or column_file(agent)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "agent": agent, "command": command, "partial": partial,
        "date": time.strftime("%Y-%m-%d"), "wall_minutes": round(wall / 60, 1),
        "results": [{"spec": r.spec, "status": r.status, "seconds": round(r.seconds),
                     "reason": r.reason} for r in results]}, indent=1) + "\n")
    return path


def load_column(path: Path) -> dict[str, object] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def columns_doc(columns: dict[str, dict | None]) -> str:
    """The kind section's table: every spec, each agent's result side by side, and why
    each one not passed did not."""
    runs = {a: c for a, c in columns.items() if c}
    by_agent = {a: {r["spec"]: r for r in c["results"]} for a, c in runs.items()}
    specs = sorted({s for results in by_agent.values() for s in results})
    lines = ["### The last runs", ""]
    for agent in AGENTS:
        c = runs.get(agent)
        if not c:
            lines.append(f"- `{agent}`: not run yet.")
            continue
        counts = {s: sum(r["status"] == s for r in c["results"])
                  for s in (run.PASSED, run.FAILED, run.SKIPPED, run.NOT_RUN)}
        lines.append(
            f"- `{agent}`{' (**partial**)' if c['partial'] else ''}, {c['date']}: "
            f"**{counts[run.PASSED]} passed, {counts[run.FAILED]} failed, "
            f"{counts[run.SKIPPED]} skipped by the spec, {counts[run.NOT_RUN]} not run** of "
            f"{len(c['results'])} in {c['wall_minutes']} min: `{c['command']}`")
    both = [s for s in specs if all(by_agent[a].get(s, {}).get("status") == run.PASSED
                                    for a in AGENTS if a in by_agent)]
    lost = [s for s in specs if by_agent.get("kubelet", {}).get(s, {}).get("status")
            == run.PASSED and by_agent.get("nodepulse", {}).get(s, {}).get("status")
            != run.PASSED]
    lines += ["", f"{len(both)} specs passed in every column run; "
              f"{len(lost)} passed with the kubelet and not with nodepulse.", "",
              "| spec | nodepulse | kubelet | why not passed |", "|---|---|---|---|"]
    for spec in specs:
        cells, why = [], []
        for agent in ("nodepulse", "kubelet"):
            r = by_agent.get(agent, {}).get(spec)
            if r is None:
                cells.append("")
                continue
            cells.append(f"{r['status']} {r['seconds']} s" if r["status"] != run.NOT_RUN
                         else r["status"])
            if r["status"] != run.PASSED and r["reason"]:
                why.append(f"{agent}: {r['reason']}")
        lines.append(f"| {_cell(spec)} | {cells[0]} | {cells[1]} | {_cell('; '.join(why))} |")
    return "\n".join(lines)


def write_columns_doc(path: Path = run.DOC) -> None:
    run.write_section("kind-conformance", columns_doc(
        {a: load_column(column_file(a)) for a in AGENTS}), path)
