"""The manifest folder source on a real temp folder with real inotify.

Time is a FakeClock: the debounce and the rescan period pass only when the test
advances it. The only real waiting is bounded waits for inotify events to arrive.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from nodeagent.api.clock import FakeClock, settle
from nodeagent.pods.podupdate import Op, PodUpdate, Source
from nodeagent.pods.sources.file import FileSource, _oserror, ignored
from nodeagent.pods.sources.merge import Merge
from nodeagent.pods.sources.problems import Problems
from tests.conftest import Sink, until

WAIT = 5.0  # bound on waiting for the kernel to deliver inotify events


def manifest(name: str, image: str = "busybox", fmt: str = "yaml") -> str:
    if fmt == "json":
        return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                           "spec": {"containers": [{"name": "c", "image": image}]}})
    return (f"apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\nspec:\n"
            f"  containers:\n  - name: c\n    image: {image}\n")


def errors(reason: str) -> float:
    return REGISTRY.get_sample_value("nodepulse_source_manifest_errors_total",
                                     {"source": "file", "reason": reason}) or 0.0


class Harness:
    def __init__(self, folder: Path, **kw: Any) -> None:
        self.dir = folder
        self.clock = FakeClock()
        self.sink = Sink()
        self.merge = Merge([Source.FILE], Problems(self.sink))
        self.src = FileSource(folder, "n1", self.merge, self.clock, debounce=0.1,
                              check_frequency=20.0, **kw)

    def ops(self) -> list[tuple[Op, list[str]]]:
        out = []
        while not self.merge.updates.empty():
            u: PodUpdate = self.merge.updates.get_nowait()
            out.append((u.op, sorted(p["metadata"]["name"] for p in u.pods)))
        return out

    def names(self) -> list[str]:
        return sorted(p["metadata"]["name"] for p in self.merge.pods())

    async def batch(self) -> None:
        """Wait (bounded) for inotify to wake the source, let the debounce pass on the
        fake clock, and wait for the batch to be processed."""
        n = self.src.batches
        await asyncio.wait_for(self.src.debouncing.wait(), WAIT)
        await self.clock.advance(0.1)
        await asyncio.wait_for(self.src.wait_batches(n + 1), WAIT)

    async def rescan(self) -> None:
        n = self.src.batches
        await self.clock.advance(20.0)
        await asyncio.wait_for(self.src.wait_batches(n + 1), WAIT)


def run(folder: Path, body: Callable[[Harness], Awaitable[None]], **kw: Any) -> None:
    async def main() -> None:
        h = Harness(folder, **kw)
        task = asyncio.create_task(h.src.run())
        try:
            await asyncio.wait_for(h.merge.ready.wait(), WAIT)
            await settle()
            await body(h)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    asyncio.run(main())


def test_ignored_names() -> None:
    for name in (".hidden.yaml", "pod.yaml~", ".pod.yaml.swp", "pod.yaml.swp", "#pod.yaml#",
                 "4913", "pod.yaml.tmp", "..data"):
        assert ignored(name), name
    for name in ("pod.yaml", "pod.json", "pod"):
        assert not ignored(name), name


def test_initial_load_then_add_edit_delete(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(manifest("a"))
    (tmp_path / "b.json").write_text(manifest("b", fmt="json"))
    (tmp_path / ".hidden.yaml").write_text(manifest("hidden"))
    (tmp_path / "c.yaml~").write_text(manifest("backup"))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.yaml").write_text(manifest("d"))

    async def body(h: Harness) -> None:
        assert h.ops() == [(Op.ADD, ["a-n1", "b-n1"])]
        (tmp_path / "c.yaml").write_text(manifest("c"))
        await h.batch()
        assert h.ops() == [(Op.ADD, ["c-n1"])]
        old_uid = h.merge.pods()[-1]["metadata"]["uid"]
        (tmp_path / "c.yaml").write_text(manifest("c", image="nginx"))
        await h.batch()
        # an edit is a new static pod (new UID): the old one is removed first
        assert h.ops() == [(Op.REMOVE, ["c-n1"]), (Op.ADD, ["c-n1"])]
        assert old_uid not in {p["metadata"]["uid"] for p in h.merge.pods()}
        (tmp_path / "a.yaml").unlink()
        await h.batch()
        assert h.ops() == [(Op.REMOVE, ["a-n1"])]
        assert h.names() == ["b-n1", "c-n1"]
    run(tmp_path, body)


def test_no_change_emits_nothing(tmp_path: Path) -> None:
    a = tmp_path / "a.yaml"
    a.write_text(manifest("a"))

    async def body(h: Harness) -> None:
        h.ops()
        pod_before = h.merge.pods()[0]
        os.utime(a)  # touch: attrib
        await h.batch()
        with open(a, "ab"):  # open for write and close: close_write, same bytes
            pass
        await h.batch()
        a.write_text(manifest("a"))  # rewrite identical content
        await h.batch()
        a.write_text("# reformatted\n" + json.dumps(json.loads(json.dumps({
            "spec": {"containers": [{"image": "busybox", "name": "c"}]},
            "metadata": {"name": "a"}, "kind": "Pod", "apiVersion": "v1"})), indent=2))
        await h.batch()  # JSON, other key order, comments: same pod
        tmp = tmp_path / ".a.yaml.tmp"
        tmp.write_text(manifest("a"))
        tmp.rename(a)  # atomic-rename save with the same content
        await h.batch()
        a.rename(tmp_path / "renamed.yaml")  # rename, same content
        await h.batch()
        assert h.ops() == []
        assert h.merge.pods() == [pod_before] and h.merge.pods()[0] is pod_before
        await h.rescan()  # the periodic rescan finds nothing new either
        assert h.ops() == []
    run(tmp_path, body)


def test_atomic_rename_with_new_content(tmp_path: Path) -> None:
    a = tmp_path / "a.yaml"
    a.write_text(manifest("a"))

    async def body(h: Harness) -> None:
        h.ops()
        tmp = tmp_path / "a.yaml.swp"
        tmp.write_text(manifest("a", image="nginx"))  # ignored: wakes nothing
        tmp.rename(a)
        await h.batch()
        assert h.ops() == [(Op.REMOVE, ["a-n1"]), (Op.ADD, ["a-n1"])]
        assert h.merge.pods()[0]["spec"]["containers"][0]["image"] == "nginx"
    run(tmp_path, body)


def test_configmap_symlink_swap(tmp_path: Path) -> None:
    v1 = tmp_path / "..2026_01"
    v1.mkdir()
    (v1 / "web.yaml").write_text(manifest("web"))
    (tmp_path / "..data").symlink_to("..2026_01")
    (tmp_path / "web.yaml").symlink_to("..data/web.yaml")

    async def body(h: Harness) -> None:
        assert h.ops() == [(Op.ADD, ["web-n1"])]
        v2 = tmp_path / "..2026_02"
        v2.mkdir()
        (v2 / "web.yaml").write_text(manifest("web", image="nginx"))
        (tmp_path / "..data_tmp").symlink_to("..2026_02")
        os.rename(tmp_path / "..data_tmp", tmp_path / "..data")
        await h.batch()
        assert h.ops() == [(Op.REMOVE, ["web-n1"]), (Op.ADD, ["web-n1"])]
        assert h.merge.pods()[0]["spec"]["containers"][0]["image"] == "nginx"
        # swapping to a new directory with the same content is no change
        v3 = tmp_path / "..2026_03"
        v3.mkdir()
        (v3 / "web.yaml").write_text(manifest("web", image="nginx"))
        (tmp_path / "..data_tmp").symlink_to("..2026_03")
        os.rename(tmp_path / "..data_tmp", tmp_path / "..data")
        await h.batch()
        assert h.ops() == []
    run(tmp_path, body)


def test_missed_events_are_caught_by_the_rescan(tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        loop = asyncio.get_running_loop()
        assert h.src._inotify is not None
        fd = h.src._inotify.fileno()
        loop.remove_reader(fd)  # the source is deaf to inotify from here on
        (tmp_path / "late.yaml").write_text(manifest("late"))
        await h.rescan()
        assert h.ops() == [(Op.ADD, ["late-n1"])]
        await h.rescan()
        assert h.ops() == []
        loop.add_reader(fd, h.src._on_readable)
    run(tmp_path, body)


def test_folder_created_later(tmp_path: Path) -> None:
    folder = tmp_path / "manifests"

    async def body(h: Harness) -> None:
        assert h.merge.ready.all_ready() and h.merge.pods() == []
        assert h.sink.events[0][0] == "StaticPodFolderUnreadable"
        assert str(folder) in h.sink.events[0][1]
        folder.mkdir()
        (folder / "a.yaml").write_text(manifest("a"))
        await h.rescan()
        assert h.ops() == [(Op.ADD, ["a-n1"])]
        (folder / "b.yaml").write_text(manifest("b"))  # watched from now on
        await h.batch()
        assert h.ops() == [(Op.ADD, ["b-n1"])]
    run(folder, body)


# -- bad input: each one reported with file and problem; others unaffected; the last
#    good version of that pod stays -----------------------------------------------------

def _relink(target: str) -> Callable[[Path], None]:
    def spoil(p: Path) -> None:
        p.unlink()
        p.symlink_to(target if target else p.name)
    return spoil


def _write(text: str) -> Callable[[Path], None]:
    def spoil(p: Path) -> None:
        p.write_text(text)
    return spoil


def _fifo(p: Path) -> None:
    # tests run as root, which reads any file whatever its mode: a FIFO renamed over
    # the manifest is what cannot be read as one (opening it must not block either)
    tmp = p.with_name(".fifo.tmp")
    os.mkfifo(tmp)
    tmp.rename(p)


def _directory(p: Path) -> None:
    p.unlink()
    p.mkdir()


def _chmod(mode: int) -> Callable[[Path], None]:
    def spoil(p: Path) -> None:
        p.chmod(mode)
    return spoil


def _restore(p: Path) -> None:
    """Undo a spoil: back to a plain regular file of mode 0644."""
    if p.is_dir() and not p.is_symlink():
        p.rmdir()
    elif p.is_symlink() or (p.exists() and not p.is_file()):
        p.unlink()
    elif p.exists():
        p.chmod(0o644)


BAD: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "malformed": (_write("apiVersion: v1\nkind: Pod\nmetadata: {name: [\n"),
                  "Malformed", "malformed YAML/JSON at line"),
    "not-a-pod": (_write("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n"),
                  "NotAPod", "not a Pod"),
    "missing-field": (_write("apiVersion: v1\nkind: Pod\nmetadata: {name: a}\n"
                             "spec: {containers: [{name: c}]}\n"),
                      "MissingField", "missing required field spec.containers[0].image"),
    "too-large": (_write(manifest("a") + "#" * (1 << 20)), "TooLarge",
                  "over the limit of 1048576 bytes"),
    "symlink-loop": (_relink(""), "Unreadable", "symlink loop"),
    "fifo": (_fifo, "Unreadable", "not a regular file (a FIFO)"),
    "directory": (_directory, "Unreadable", "is now a directory"),
    # a symlink out of the folder (here to a file that not even root can read: EIO)
    "symlink-out": (_relink("/proc/self/mem"), "Insecure", "outside the manifest folder"),
    "world-writable": (_chmod(0o666), "Insecure", "world-writable (mode 0666)"),
    "host-network": (_write(manifest("a") + "  hostNetwork: true\n"), "Forbidden",
                     "spec.hostNetwork is set"),
    "privileged": (_write(manifest("a") + "    securityContext: {privileged: true}\n"),
                   "Forbidden", "spec.containers[0].securityContext.privileged is set"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_file_keeps_last_good_version(tmp_path: Path, case: str,
                                         caplog: pytest.LogCaptureFixture) -> None:
    spoil, reason, words = BAD[case]
    a = tmp_path / "a.yaml"
    a.write_text(manifest("a"))
    (tmp_path / "other.yaml").write_text(manifest("other"))

    async def body(h: Harness) -> None:
        h.ops()
        good = list(h.merge.pods())
        before = errors(reason)
        spoil(a)
        await h.batch()
        assert h.ops() == []
        assert h.merge.pods() == good  # a's last good pod and the other pod stay
        assert errors(reason) == before + 1
        (ev_reason, message), = h.sink.events
        assert ev_reason == f"StaticPod{reason}"
        assert str(a) in message and words in message
        assert "keeping the last good version of pod default/a-n1" in message
        logged = [r for r in caplog.records if r.levelname == "WARNING"
                  and str(a) in r.getMessage() and words in r.getMessage()]
        assert len(logged) == 1
        await h.rescan()  # the same problem is not reported again
        assert len(h.sink.events) == 1 and errors(reason) == before + 1
        (tmp_path / "new.yaml").write_text(manifest("new"))  # others still flow
        await h.batch()
        assert h.ops() == [(Op.ADD, ["new-n1"])]
        _restore(a)
        a.write_text(manifest("a"))  # fixed, back to the same content: no change
        await h.batch()
        assert h.ops() == []
        a.write_text(manifest("a", image="fixed"))
        await h.batch()
        assert h.ops() == [(Op.REMOVE, ["a-n1"]), (Op.ADD, ["a-n1"])]
    run(tmp_path, body)


def test_os_errors_are_named() -> None:
    # as root (the test run) a file's mode cannot make it unreadable; the mapping is
    # checked here and a real unreadable file (/proc/self/mem, EIO) in the cases above
    assert _oserror(PermissionError(errno.EACCES, "Permission denied")) == \
        "unreadable: permission denied"
    assert _oserror(OSError(errno.ELOOP, "Too many levels")).startswith("symlink loop")
    assert _oserror(OSError(errno.EIO, "Input/output error")) == \
        "unreadable: Input/output error"


def test_bad_file_at_start_is_reported_and_others_load(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("kind: [")
    (tmp_path / "good.yaml").write_text(manifest("good"))

    async def body(h: Harness) -> None:
        assert h.ops() == [(Op.ADD, ["good-n1"])]
        assert len(h.sink.events) == 1 and "bad.yaml" in h.sink.events[0][1]
        assert "keeping" not in h.sink.events[0][1]
    run(tmp_path, body)


def test_two_files_same_pod_name(tmp_path: Path) -> None:
    (tmp_path / "b.yaml").write_text(manifest("web"))

    async def body(h: Harness) -> None:
        assert h.ops() == [(Op.ADD, ["web-n1"])]
        (tmp_path / "a.yaml").write_text(manifest("web", image="other"))
        await h.batch()
        # b.yaml had the name first and keeps it, although a.yaml sorts first
        assert h.ops() == []
        assert h.merge.pods()[0]["spec"]["containers"][0]["image"] == "busybox"
        (reason, message), = h.sink.events
        assert reason == "StaticPodDuplicate"
        assert f"{tmp_path / 'a.yaml'}: pod default/web-n1 is already defined by " \
               f"{tmp_path / 'b.yaml'}" in message
        (tmp_path / "b.yaml").unlink()
        await h.batch()  # the owner goes: a.yaml's pod takes the name
        assert h.ops() == [(Op.REMOVE, ["web-n1"]), (Op.ADD, ["web-n1"])]
        assert h.merge.pods()[0]["spec"]["containers"][0]["image"] == "other"
    run(tmp_path, body)


def test_duplicates_at_start_resolve_by_file_name(tmp_path: Path) -> None:
    (tmp_path / "b.yaml").write_text(manifest("web"))
    (tmp_path / "a.yaml").write_text(manifest("web", image="from-a"))

    async def body(h: Harness) -> None:
        assert h.ops() == [(Op.ADD, ["web-n1"])]
        assert h.merge.pods()[0]["spec"]["containers"][0]["image"] == "from-a"
        assert "b.yaml: pod default/web-n1 is already defined" in h.sink.events[0][1]
    run(tmp_path, body)


def test_debounce_gathers_a_burst_into_one_batch(tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        n = h.src.batches
        for i in range(5):
            (tmp_path / f"p{i}.yaml").write_text(manifest(f"p{i}"))
        await asyncio.wait_for(h.src.debouncing.wait(), WAIT)
        # let every close_write arrive while the debounce is still running
        await until(lambda: len(h.src._pending) == 5)
        await h.clock.advance(0.1)
        await asyncio.wait_for(h.src.wait_batches(n + 1), WAIT)
        assert h.ops() == [(Op.ADD, [f"p{i}-n1" for i in range(5)])]
        assert h.src.batches == n + 1
    run(tmp_path, body)


# -- security of the folder -------------------------------------------------------------

def test_world_writable_folder_at_start_runs_nothing(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(manifest("a"))
    tmp_path.chmod(0o777)

    async def body(h: Harness) -> None:
        assert h.merge.ready.all_ready() and h.merge.pods() == []
        (reason, message), = h.sink.events
        assert reason == "StaticPodFolderInsecure"
        assert f"manifest folder {tmp_path} is world-writable (mode 0777)" in message
        tmp_path.chmod(0o755)  # fixed: the folder's own attrib event, a full scan
        await h.batch()
        assert h.ops() == [(Op.ADD, ["a-n1"])]
    run(tmp_path, body)


def test_folder_made_world_writable_keeps_what_runs_and_reads_nothing(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(manifest("a"))

    async def body(h: Harness) -> None:
        assert h.ops() == [(Op.ADD, ["a-n1"])]
        running = h.merge.pods()
        tmp_path.chmod(0o1777)  # sticky or not: anyone may add a file
        await h.batch()
        (tmp_path / "b.yaml").write_text(manifest("b"))  # anyone's
        (tmp_path / "a.yaml").write_text(manifest("a", image="evil"))
        await h.batch()
        await h.rescan()
        assert h.ops() == [] and h.merge.pods() == running
        assert [r for r, _ in h.sink.events] == ["StaticPodFolderInsecure"]
        assert "mode 1777" in h.sink.events[0][1]
        tmp_path.chmod(0o755)
        await h.batch()
        assert h.ops() == [(Op.REMOVE, ["a-n1"]), (Op.ADD, ["a-n1", "b-n1"])]
        assert len(h.sink.events) == 1
    run(tmp_path, body)


def test_world_writable_file_at_start_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(manifest("a"))
    (tmp_path / "a.yaml").chmod(0o646)
    (tmp_path / "b.yaml").write_text(manifest("b"))

    async def body(h: Harness) -> None:
        assert h.ops() == [(Op.ADD, ["b-n1"])]
        (reason, message), = h.sink.events
        assert reason == "StaticPodInsecure"
        assert f"{tmp_path / 'a.yaml'}: world-writable (mode 0646)" in message
    run(tmp_path, body)


def test_symlinks_within_the_folder_are_followed(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "in.yaml").write_text(manifest("inside"))
    (tmp_path / "link.yaml").symlink_to("sub/in.yaml")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.yaml"
    outside.write_text(manifest("outside"))
    (tmp_path / "out.yaml").symlink_to(outside)
    (tmp_path / "dotdot.yaml").symlink_to(f"../{outside.name}")

    async def body(h: Harness) -> None:
        assert h.ops() == [(Op.ADD, ["inside-n1"])]
        refused = sorted(m for r, m in h.sink.events if r == "StaticPodInsecure")
        assert len(refused) == 2
        assert f"{tmp_path / 'dotdot.yaml'}: a symlink to {outside}, outside" in refused[0]
        assert f"{tmp_path / 'out.yaml'}: a symlink to {outside}, outside" in refused[1]
    try:
        run(tmp_path, body)
    finally:
        outside.unlink()


def test_host_access_only_when_allowed(tmp_path: Path) -> None:
    (tmp_path / "net.yaml").write_text(manifest("net") + "  hostNetwork: true\n")
    (tmp_path / "pid.yaml").write_text(manifest("pid") + "  hostPID: true\n")
    # not a boolean: refused either way (the runtime would read "false" as true)
    (tmp_path / "str.yaml").write_text(manifest("str") + "  hostIPC: 'false'\n")
    (tmp_path / "priv.yaml").write_text(
        manifest("priv") + "  initContainers: [{name: i, image: x, "
        "securityContext: {privileged: true}}]\n")
    (tmp_path / "plain.yaml").write_text(manifest("plain") + "  hostIPC: false\n")

    async def refused(h: Harness) -> None:
        assert h.ops() == [(Op.ADD, ["plain-n1"])]
        got = sorted(m.split(": ")[2] for r, m in h.sink.events
                     if r == "StaticPodForbidden")
        assert got == ["spec.hostNetwork is set", "spec.hostPID is set",
                       "spec.initContainers[0].securityContext.privileged is set"]
        assert all("allowPrivileged: true" in m for r, m in h.sink.events
                   if r == "StaticPodForbidden")
        assert [r for r, _ in h.sink.events].count("StaticPodInvalidField") == 1

    async def allowed(h: Harness) -> None:
        assert h.ops() == [(Op.ADD, ["net-n1", "pid-n1", "plain-n1", "priv-n1"])]
        (reason, message), = h.sink.events
        assert reason == "StaticPodInvalidField"
        assert "str.yaml: spec.hostIPC must be true or false, got 'false'" in message
    run(tmp_path, refused)
    run(tmp_path, allowed, allow_privileged=True)


# -- a file that keeps changing does not thrash its pod ---------------------------------

def test_flapping_file_is_held_and_the_latest_content_applied(tmp_path: Path) -> None:
    a = tmp_path / "a.yaml"
    a.write_text(manifest("a", image="v0"))

    def image(h: Harness) -> str:
        return str(h.merge.pods()[0]["spec"]["containers"][0]["image"])

    async def write(h: Harness, version: int) -> None:
        tmp = tmp_path / ".a.tmp"
        tmp.write_text(manifest("a", image=f"v{version}"))
        tmp.rename(a)
        await h.batch()

    async def body(h: Harness) -> None:
        h.ops()
        held = REGISTRY.get_sample_value("nodepulse_source_file_changes_held_total") or 0
        await h.rescan()  # the initial load is a while ago
        await write(h, 1)  # a first change applies at once
        assert image(h) == "v1"
        await write(h, 2)  # a second one soon after too, and starts the hold (1 s)
        assert image(h) == "v2"
        assert [r for r, _ in h.sink.events] == ["StaticPodFlapping"]
        for v in range(3, 8):  # 0.5 s of fake time: all held
            await write(h, v)
        assert image(h) == "v2"
        assert h.src._held  # looked at again when the hold ends
        n = h.src.batches
        await h.clock.advance(0.5)  # the hold ends: the latest content applies
        await asyncio.wait_for(h.src.wait_batches(n + 1), WAIT)
        assert image(h) == "v7"
        assert h.ops() == [(Op.REMOVE, ["a-n1"]), (Op.ADD, ["a-n1"])] * 3
        assert (REGISTRY.get_sample_value("nodepulse_source_file_changes_held_total")
                or 0) >= held + 5
        await write(h, 8)  # still changing: held again, now for 2 s
        assert image(h) == "v7"
        await h.clock.advance(1.0)
        assert image(h) == "v7"
        n = h.src.batches
        await h.clock.advance(1.0)
        await asyncio.wait_for(h.src.wait_batches(n + 1), WAIT)
        assert image(h) == "v8"
        n = h.src.batches
        await h.clock.advance(30.0)  # quiet for a while: the next change applies at once
        await asyncio.wait_for(h.src.wait_batches(n + 1), WAIT)
        await write(h, 9)
        assert image(h) == "v9"
        assert len(h.sink.events) == 1  # the Flapping report, once
    run(tmp_path, body)
