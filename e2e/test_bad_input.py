"""Bad input, end to end: one real `nodepulse-agent` process (node credentials, the
fake runtime: what is tested here is the agent's input, not its containers) with a
static manifest folder, a manifest URL served by this test, and a config file.

Each bad input must give a Warning Event on the Node naming the file or URL and the
field, leave the other pods alone (two good static pods, one from the folder and one
from the URL, keep running with the same mirror pod and the same container), and lose
nothing (a pod whose manifest turns bad keeps its last good version). A manifest that
changes 100 times a second must not thrash its pod (the agent's own metrics witness
the bound). A bad config makes the agent exit non-zero naming the key; a running
agent refuses a bad config change and keeps its settings.

Tests run as root, for whom a file's mode never stops a read: "unreadable" is a FIFO
renamed over a manifest (and a symlink loop), which no read turns into a manifest.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.harness.ports import free_port
from e2e.harness.promtext import samples
from e2e.harness.waits import eventually
from nodepulse_dev import Cluster
from nodepulse_dev.processes import stop_process

AGENT = Path(sys.executable).parent / "nodepulse-agent"
TAINT_KEY = "nodepulse.dev/e2e-bad-input"
WAIT = 60.0
BODY_LIMIT = 16 << 20   # nodeagent.pods.sources.http.MAX_BODY_BYTES
FILE_LIMIT = 1 << 20    # nodeagent.pods.sources.static.MAX_MANIFEST_BYTES
HUGE = 50 << 20
T = TypeVar("T")


def pod_manifest(name: str, image: str = "busybox:1", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": {"app": name}},
            "spec": {"containers": [{"name": "c", "image": image,
                                     "command": ["sleep", "3600"]}], **spec}}


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.rename(path)


class URLServer:
    """The manifest URL. `mode`: good, 500, html, binary, huge (50 MB with a
    Content-Length), huge-nolength (50 MB, the end is the connection's close), hang
    (no answer until `release` is set), drip (a byte every 0.5 s of a 1 MB body, until
    `release` is set)."""

    def __init__(self) -> None:
        self.mode = "good"
        self.good = b""
        self.sent = 0      # bytes of bad bodies sent, over all requests
        self.largest = 0   # the most sent in one response (the agent fetches every 1 s)
        self.release = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                mode = owner.mode
                if mode == "hang":
                    owner.release.wait(60)
                    return
                if mode == "drip":
                    self.send_response(200)
                    self.send_header("Content-Length", str(1 << 20))
                    self.end_headers()
                    try:
                        while not owner.release.wait(0.5):
                            self.wfile.write(b"#")
                            self.wfile.flush()
                            owner.sent += 1
                    except OSError:
                        pass  # the agent hung up: what it was meant to do
                    return
                if mode == "500":
                    self.send_response(500)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if mode.startswith("huge"):
                    self.send_response(200)
                    if mode == "huge":
                        self.send_header("Content-Length", str(HUGE))
                    self.end_headers()
                    chunk = b"#" * (1 << 16)
                    this = 0
                    try:
                        for _ in range(HUGE // len(chunk)):
                            self.wfile.write(chunk)
                            owner.sent += len(chunk)
                            this += len(chunk)
                            owner.largest = max(owner.largest, this)
                    except OSError:
                        pass  # the agent hung up: what it was meant to do
                    return
                body = {"good": owner.good,
                        "html": b"<html><body>503 Service Unavailable</body></html>\n",
                        "binary": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"}[mode]
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       kwargs={"poll_interval": 0.1}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/pods.yaml"

    def stop(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@dataclass
class Agent:
    name: str
    root: Path
    manifests: Path
    config: Path
    server: URLServer
    proc: subprocess.Popen[bytes]
    metrics_url: str
    core: client.CoreV1Api
    baseline: dict[str, tuple[str, str]] = field(default_factory=dict)  # mirror: (uid, cid)

    def metrics(self) -> str:
        import urllib.request
        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
            return str(r.read().decode())

    def metric(self, name: str, **labels: str) -> float:
        return samples(self.metrics(), name, **labels)

    def log(self) -> str:
        return (self.root / "agent.log").read_text(errors="replace")

    def mirror(self, pod: str) -> client.V1Pod | None:
        try:
            return self.core.read_namespaced_pod(f"{pod}-{self.name}", "default")
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def running(self, pod: str) -> client.V1Pod | None:
        p = self.mirror(pod)
        st = p.status if p else None
        ok = bool(st and st.phase == "Running" and st.container_statuses
                  and all(c.ready and c.state.running for c in st.container_statuses))
        return p if ok else None

    def event(self, reason: str, *words: str) -> client.CoreV1Event:
        """The Warning Event on the Node with this reason whose message has every word."""
        def find() -> client.CoreV1Event | None:
            evs = self.core.list_namespaced_event(
                "default", field_selector=f"involvedObject.name={self.name}").items
            return next((e for e in evs if e.reason == reason
                         and all(w in (e.message or "") for w in words)), None)
        try:
            ev = eventually(find, f"a {reason} Event with {words}")
        except AssertionError:
            print(self.log()[-4000:])
            raise
        assert ev.type == "Warning" and ev.involved_object.kind == "Node"
        return ev

    def scans(self) -> float:
        return self.metric("nodepulse_source_file_scans_total", trigger="rescan")

    def after_rescans(self, n: int = 2) -> None:
        """Return once the folder has been rescanned `n` more times (absence needs it)."""
        start = self.scans()
        eventually(lambda: self.scans() >= start + n, f"{n} rescans of the folder", 30)

    def unaffected(self) -> None:
        """The good pods still run: same mirror pod, same container, no restart."""
        for pod, (uid, cid) in self.baseline.items():
            p = self.running(pod)
            assert p is not None, f"{pod} is no longer running"
            assert p.metadata.uid == uid, f"{pod}'s mirror pod was replaced"
            cs = p.status.container_statuses[0]
            assert cs.container_id == cid and cs.restart_count == 0, f"{pod} restarted"


def start_agent(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


@pytest.fixture(scope="module")
def agent(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    name = f"bad-{uuid.uuid4().hex[:6]}"
    root = tmp_path_factory.mktemp(name)
    manifests = root / "manifests"
    manifests.mkdir(mode=0o755)
    manifests.chmod(0o755)
    (manifests / "keeper.yaml").write_text(json.dumps(pod_manifest("keeper")))
    config = root / "agent.yaml"
    config.write_text("maxPods: 50\n")
    server = URLServer()
    server.good = json.dumps({"apiVersion": "v1", "kind": "PodList",
                              "items": [pod_manifest("url-keeper")]}).encode()
    server.thread.start()
    kubeconfig = cluster.node_kubeconfig(name)
    port = free_port()
    argv = [str(AGENT), f"--node-name={name}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={root}", f"--healthz-bind-address=127.0.0.1:{port}",
            f"--config={config}", "--runtime=fake", "--node-status-update-frequency=2s",
            f"--pod-manifest-path={manifests}", "--file-check-frequency=2s",
            f"--manifest-url={server.url}", "--http-check-frequency=1s",
            f"--register-with-taints={TAINT_KEY}=x:NoSchedule"]
    admin = cluster.api_client()
    proc = start_agent(argv, root / "agent.log")
    a = Agent(name, root, manifests, config, server, proc,
              f"http://127.0.0.1:{port}/metrics", client.CoreV1Api(admin))
    try:
        for pod in ("keeper", "url-keeper"):
            def up(pod: str = pod) -> client.V1Pod | None:
                return a.running(pod)
            try:
                p = eventually(up, f"{pod} Running", 90)
            except AssertionError:
                print(a.log()[-4000:])
                raise
            a.baseline[pod] = (p.metadata.uid, p.status.container_statuses[0].container_id)
        yield a
    finally:
        stop_process(proc)
        server.stop()
        for p in a.core.list_namespaced_pod(
                "default", field_selector=f"spec.nodeName={name}").items:
            with contextlib.suppress(ApiException):
                a.core.delete_namespaced_pod(p.metadata.name, "default", grace_period_seconds=0)
        with contextlib.suppress(ApiException):
            a.core.delete_node(name)
        admin.close()


# -- static manifests -----------------------------------------------------------------

def _write(text: str) -> Callable[[Path], None]:
    def make(p: Path) -> None:
        p.write_text(text)
    return make


def _loop(p: Path) -> None:
    p.symlink_to(p.name)


def _world_writable(p: Path) -> None:
    tmp = p.with_name(f".{p.name}.tmp")  # mode 0666 before the agent can see it
    tmp.write_text(json.dumps(pod_manifest("ww")))
    tmp.chmod(0o666)
    tmp.rename(p)


def _outside(p: Path) -> None:
    target = p.parent.parent / "outside.yaml"
    target.write_text(json.dumps(pod_manifest("outside")))
    p.symlink_to(target)


BAD_FILES: dict[str, tuple[Callable[[Path], None], str, list[str], str | None]] = {
    # case: (make the file, Event reason, words of its message, pod that must not run)
    "malformed": (_write("apiVersion: v1\nkind: Pod\nmetadata: {name: [\n"), "Malformed",
                  ["malformed YAML/JSON at line"], None),
    "not-a-pod": (_write("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: cm}\n"),
                  "NotAPod", ["not a Pod: kind is 'ConfigMap'"], None),
    "bad-field": (_write(json.dumps(pod_manifest("badfield", restartPolicy="Sometimes"))),
                  "InvalidField", ["spec.restartPolicy must be one of"], "badfield"),
    "huge": (_write(json.dumps(pod_manifest("huge")) + "\n#" + "x" * FILE_LIMIT), "TooLarge",
             [f"over the limit of {FILE_LIMIT} bytes"], "huge"),
    "symlink-loop": (_loop, "Unreadable", ["symlink loop"], None),
    "world-writable": (_world_writable, "Insecure", ["world-writable (mode 0666)"], "ww"),
    "symlink-out": (_outside, "Insecure", ["outside the manifest folder"], "outside"),
    "host-network": (_write(json.dumps(pod_manifest("hostnet", hostNetwork=True))),
                     "Forbidden", ["spec.hostNetwork is set", "allowPrivileged: true"],
                     "hostnet"),
    "privileged": (_write(json.dumps({**pod_manifest("priv"), "spec": {"containers": [
        {"name": "c", "image": "busybox:1", "securityContext": {"privileged": True}}]}})),
        "Forbidden", ["spec.containers[0].securityContext.privileged is set"], "priv"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_manifest_file(agent: Agent, case: str) -> None:
    make, reason, words, pod = BAD_FILES[case]
    path = agent.manifests / f"{case}.yaml"
    errors = agent.metric("nodepulse_source_manifest_errors_total", source="file",
                          reason=reason)
    make(path)
    try:
        ev = agent.event(f"StaticPod{reason}", str(path), *words)
        print(f"\n[{case}] {ev.reason}: {ev.message[:300]}")
        assert agent.metric("nodepulse_source_manifest_errors_total", source="file",
                            reason=reason) == errors + 1
        if pod is not None:
            agent.after_rescans()
            assert agent.mirror(pod) is None, f"{pod} runs from a refused manifest"
        agent.unaffected()
    finally:
        path.unlink()
        (agent.root / "outside.yaml").unlink(missing_ok=True)


def test_duplicate_name(agent: Agent) -> None:
    dup = agent.manifests / "dup.yaml"
    dup.write_text(json.dumps(pod_manifest("keeper", image="busybox:other")))
    try:
        agent.event("StaticPodDuplicate", f"{dup}: pod default/keeper-{agent.name} is already "
                    f"defined by {agent.manifests / 'keeper.yaml'}")
        agent.after_rescans()
        agent.unaffected()
        keeper = agent.mirror("keeper")
        assert keeper is not None and keeper.spec.containers[0].image == "busybox:1"
    finally:
        dup.unlink()


def test_unreadable_manifest_keeps_its_last_good_pod(agent: Agent) -> None:
    """A FIFO renamed over a running pod's manifest: reported, the pod stays."""
    victim = agent.manifests / "victim.yaml"
    victim.write_text(json.dumps(pod_manifest("victim")))
    p = eventually(lambda: agent.running("victim"), "victim Running")
    fifo = agent.manifests / ".victim.fifo"
    os.mkfifo(fifo)
    fifo.rename(victim)
    try:
        agent.event("StaticPodUnreadable", f"{victim}: not a regular file (a FIFO)",
                    f"keeping the last good version of pod default/victim-{agent.name}")
        agent.after_rescans()
        still = agent.running("victim")
        assert still is not None and still.metadata.uid == p.metadata.uid
        agent.unaffected()
    finally:
        victim.unlink()
    eventually(lambda: agent.mirror("victim") is None, "victim's mirror pod deleted")


def test_configmap_style_symlinks_are_followed(agent: Agent) -> None:
    """`cm.yaml -> ..data/cm.yaml`, `..data -> ..v1`: inside the folder, so followed;
    the atomic swap of `..data` replaces the pod."""
    d = agent.manifests
    (d / "..v1").mkdir()
    (d / "..v1" / "cm.yaml").write_text(json.dumps(pod_manifest("cm")))
    (d / "..data").symlink_to("..v1")
    (d / "cm.yaml").symlink_to("..data/cm.yaml")
    try:
        first = eventually(lambda: agent.running("cm"), "cm Running")
        (d / "..v2").mkdir()
        (d / "..v2" / "cm.yaml").write_text(json.dumps(pod_manifest("cm", image="busybox:2")))
        (d / "..data_tmp").symlink_to("..v2")
        os.rename(d / "..data_tmp", d / "..data")
        p = eventually(lambda: (x := agent.running("cm")) and x.metadata.uid != first.metadata.uid
                       and x, "cm replaced after the ..data swap")
        assert p.spec.containers[0].image == "busybox:2"
        agent.unaffected()
    finally:
        for f in ("cm.yaml", "..data", "..v1/cm.yaml", "..v2/cm.yaml"):
            (d / f).unlink(missing_ok=True)
        for sub in ("..v1", "..v2"):
            with contextlib.suppress(OSError):
                (d / sub).rmdir()
    eventually(lambda: agent.mirror("cm") is None, "cm's mirror pod deleted")


def test_world_writable_folder(agent: Agent) -> None:
    """Refused: nothing new is read; what runs keeps running; fixed -> read again."""
    d = agent.manifests
    d.chmod(0o777)
    try:
        agent.event("StaticPodFolderInsecure",
                    f"manifest folder {d} is world-writable (mode 0777)")
        (d / "late.yaml").write_text(json.dumps(pod_manifest("late")))
        agent.after_rescans()
        assert agent.mirror("late") is None, "a pod ran from a world-writable folder"
        agent.unaffected()
    finally:
        d.chmod(0o755)
    eventually(lambda: agent.running("late"), "late Running once the folder is fixed")
    (d / "late.yaml").unlink()
    eventually(lambda: agent.mirror("late") is None, "late's mirror pod deleted")
    agent.unaffected()


def test_manifest_changing_100_times_a_second(agent: Agent) -> None:
    """500 rewrites aimed at 100 a second (atomic renames, each a new image tag): the
    pod is replaced a bounded number of times, and the last content is what finally
    runs. The bound follows from how long the writes took, not from the aim, so a
    loaded machine that writes slower does not change what is asserted."""
    flap = agent.manifests / "flap.yaml"
    adds0 = agent.metric("nodepulse_source_updates_total", op="ADD", source="file")
    creates0 = agent.metric("nodepulse_mirror_pod_writes_total", verb="create", result="ok")
    held0 = agent.metric("nodepulse_source_file_changes_held_total")
    writes = 500
    start = time.monotonic()
    for n in range(1, writes + 1):
        write_atomic(flap, json.dumps(pod_manifest("flap", image=f"busybox:{n}")))
        time.sleep(0.01)
    took = time.monotonic() - start
    try:
        last = f"busybox:{writes}"
        p = eventually(lambda: (x := agent.running("flap")) and
                       x.spec.containers[0].image == last and x,
                       f"the last version ({last}) running", 60)
        adds = agent.metric("nodepulse_source_updates_total", op="ADD", source="file") - adds0
        creates = agent.metric("nodepulse_mirror_pod_writes_total", verb="create",
                               result="ok") - creates0
        held = agent.metric("nodepulse_source_file_changes_held_total") - held0
        print(f"\n{writes} writes in {took:.1f} s -> {adds:.0f} pod versions started, "
              f"{creates:.0f} mirror pod creates, {held:.0f} changes held; the last one "
              f"runs ({p.spec.containers[0].image})")
        # Applied: the first two writes, one when the 1 s hold ends, then one every 2 s
        # (the hold doubles up to --file-check-frequency, 2s), the final content, and one
        # to spare for a hold that ends just as the writes stop.
        bound = 5 + max(0.0, took - 1) / 2
        assert adds <= bound, f"{adds} pod versions for {writes} writes in {took:.1f} s"
        assert creates <= bound and held > 0
        agent.event("StaticPodFlapping", f"{flap}: changes more often than every 1s")
        agent.unaffected()
    finally:
        flap.unlink()
    eventually(lambda: agent.mirror("flap") is None, "flap's mirror pod deleted")


# -- the manifest URL -----------------------------------------------------------------

BAD_URL: dict[str, tuple[str, list[str]]] = {
    "500": ("HTTPError", ["HTTP 500"]),
    "html": ("NotAPod", ["not a Pod: the document is a str"]),
    "binary": ("Malformed", ["not UTF-8 text (byte 0)"]),
    "huge": ("TooLarge", [f"Content-Length {HUGE} is over the limit of {BODY_LIMIT} bytes"]),
    "huge-nolength": ("TooLarge", [f"body over the limit of {BODY_LIMIT} bytes"]),
    "hang": ("Unreachable", ["timed out"]),
    "drip": ("Unreachable", ["the body was not complete within 10s"]),
}


def peak_rss(pid: int) -> int:
    """VmHWM: the most resident memory the process ever had, in bytes."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", list(BAD_URL))
def test_bad_manifest_url(agent: Agent, mode: str) -> None:
    reason, words = BAD_URL[mode]
    srv = agent.server
    srv.sent, srv.largest, srv.release = 0, 0, threading.Event()
    peak0 = peak_rss(agent.proc.pid)
    srv.mode = mode
    try:
        ev = agent.event(f"StaticPod{reason}", srv.url, *words,
                         "keeping the last good set (1 pods)")
        print(f"\n[{mode}] {ev.reason}: {ev.message[:300]}")
        agent.unaffected()  # the URL's last good set (url-keeper) keeps running
    finally:
        srv.mode = "good"
        srv.release.set()
    if mode.startswith("huge"):
        grew = peak_rss(agent.proc.pid) - peak0
        print(f"[{mode}] the server sent at most {srv.largest >> 20} MiB of "
              f"{HUGE >> 20} MiB in one response ({srv.sent >> 20} MiB in all); "
              f"agent peak RSS grew {grew >> 20} MiB")
        assert srv.largest < HUGE, "the agent read a whole 50 MB body"
        assert grew < 40 << 20, f"the agent's peak memory grew {grew >> 20} MiB"
    agent.unaffected()


def test_privileged_pod_in_url_body(agent: Agent) -> None:
    srv = agent.server
    good = srv.good
    srv.good = json.dumps({"apiVersion": "v1", "kind": "PodList", "items": [
        pod_manifest("url-keeper"), pod_manifest("url-pid", hostPID=True)]}).encode()
    try:
        agent.event("StaticPodForbidden", f"{srv.url} (pod default/url-pid): spec.hostPID "
                    "is set", "keeping the last good set (1 pods)")
        assert agent.mirror("url-pid") is None
        agent.unaffected()
    finally:
        srv.good = good


# -- the agent's config ---------------------------------------------------------------

@pytest.mark.parametrize("text, words", [
    ("maxPods: 50\nbogusKey: 1\n", "unknown key(s) bogusKey"),
    ("maxPods: 0\n", "maxPods: must be between 1 and 100000, got 0"),
    ("nodeLeaseDurationSeconds: 99999\n", "nodeLeaseDurationSeconds: must be between 5 and"),
    ("allowPrivileged: perhaps\n", "allowPrivileged: expected true or false, got 'perhaps'"),
    ("fileCheckFrequency: -5\n", "fileCheckFrequency: must not be negative, got -5"),
], ids=["unknown-key", "max-pods-0", "lease-duration", "allow-privileged", "negative"])
def test_bad_config_at_start_exits_naming_the_key(cluster: Cluster, tmp_path: Path,
                                                 text: str, words: str) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    name = f"badcfg-{uuid.uuid4().hex[:6]}"
    done = subprocess.run([str(AGENT), f"--node-name={name}", f"--config={cfg}",
                           f"--kubeconfig={cluster.kubeconfig}", "--runtime=fake"],
                          capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    err = done.stderr.decode()
    print(f"\nexit {done.returncode}: {err.strip()}")
    assert done.returncode == 2
    assert err.startswith("nodepulse-agent: error: ") and str(cfg) in err and words in err
    with pytest.raises(ApiException) as gone:
        client.CoreV1Api(cluster.api_client()).read_node(name)
    assert gone.value.status == 404  # it never registered


def test_bad_config_change_is_refused_by_a_running_agent(agent: Agent) -> None:
    def capacity() -> str:
        return str(agent.core.read_node(agent.name).status.capacity["pods"])

    assert capacity() == "50"
    for text, words in (("maxPods: 40\nbogusKey: 1\n", "unknown key(s) bogusKey"),
                        ("maxPods: 0\n", "maxPods: must be between 1 and 100000, got 0")):
        agent.config.write_text(text)

        def refused(words: str = words) -> bool:
            log = agent.log()
            return "config file changed but was refused" in log and words in log
        eventually(refused, f"the agent to refuse {words!r}")
        assert agent.proc.poll() is None, "the agent exited on a bad config change"
        assert capacity() == "50"
        agent.unaffected()
    agent.config.write_text("maxPods: 60\n")  # a good change is taken: the refusals were real
    eventually(lambda: capacity() == "60", "the good config change applied")
    agent.config.write_text("maxPods: 50\n")
    eventually(lambda: capacity() == "50", "back to maxPods 50")
    agent.unaffected()


# -- allowPrivileged: the same source, allowed, runs the pod (its mirror pod appears) ---

def test_host_network_static_pod_when_allowed(cluster: Cluster, tmp_path: Path) -> None:
    """FileSource(allow_privileged=True), the API watch and the mirror manager with a
    node's credentials: the hostNetwork pod is delivered and NodeRestriction admits its
    mirror pod. (The agent process passes allowPrivileged to the sources in its
    composition root, nodeagent/agent.py.)"""
    import asyncio

    from e2e.harness.apirequests import request_json
    from nodeagent.api.client import load_credentials, new_api_client
    from nodeagent.api.clock import RealClock
    from nodeagent.api.kube import RestKube
    from nodeagent.pods.podupdate import Source
    from nodeagent.pods.sources.api import APISource
    from nodeagent.pods.sources.file import FileSource
    from nodeagent.pods.sources.merge import Merge
    from nodeagent.pods.sources.mirror import MirrorManager
    from nodeagent.pods.sources.problems import Problems

    node = f"allow-{uuid.uuid4().hex[:6]}"
    api = new_api_client(cluster.node_kubeconfig(node), component="e2e-node")
    creds = load_credentials(cluster.node_kubeconfig(node))
    uid = request_json(api, "POST", "/api/v1/nodes", body={
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})["metadata"]["uid"]
    folder = tmp_path / "manifests"
    folder.mkdir()
    folder.chmod(0o755)
    (folder / "net.yaml").write_text(json.dumps(pod_manifest("net", hostNetwork=True)))
    core = client.CoreV1Api(cluster.api_client())

    def mirror() -> client.V1Pod | None:
        try:
            return core.read_namespaced_pod(f"net-{node}", "default")
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    async def body() -> None:
        clock = RealClock()
        problems = Problems()
        merge = Merge([Source.API, Source.FILE], problems)
        kube = RestKube(creds)
        tasks = [asyncio.create_task(x.run()) for x in (
            FileSource(folder, node, merge, clock, allow_privileged=True),
            APISource(kube, [node], merge, clock),
            MirrorManager(kube, node, merge, clock, node_uid=lambda: uid))]
        try:
            deadline = time.monotonic() + WAIT
            while (m := await asyncio.to_thread(mirror)) is None:
                assert time.monotonic() < deadline, "no mirror pod for the allowed pod"
                await asyncio.sleep(0.2)
            assert m.spec.host_network is True and m.spec.node_name == node
            assert [p["metadata"]["name"] for p in merge.pods()] == [f"net-{node}"]
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await kube.aclose()
    try:
        asyncio.run(body())
    finally:
        with contextlib.suppress(ApiException):
            core.delete_namespaced_pod(f"net-{node}", "default", grace_period_seconds=0)
        with contextlib.suppress(ApiException):
            core.delete_node(node)
        api.close()
