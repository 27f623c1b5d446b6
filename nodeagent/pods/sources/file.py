"""The manifest folder source (`--pod-manifest-path`): inotify, content hashes, rescans.

What decides a change is the content: each file's raw bytes are digested, and only when
they differ is the file parsed; the parsed pod's UID is the hash of its normalized
content (nodeagent.pods.sources.static), so a touch, an identical rewrite, reformatting, or a
rename that ends with the same content gives the same pod object and the merge emits
nothing.

inotify (create, close_write, moved_to/from, delete, attrib) tells which names to look
at; events are collected for `debounce` seconds so an editor's save or a ConfigMap
symlink swap is handled as one batch. A full rescan every `check_frequency` seconds
(20 s, the kubelet's fileCheckFrequency) is the safety net for missed events.

Ignored names: hidden files (leading "."), editor leftovers (`~`, `.swp`, `.swx`,
`.tmp`, `.bak`, `.part`, `#...#`, vim's `4913`) and subdirectories. Events on names
starting with ".." (a ConfigMap mount's `..data` swap) trigger a full rescan, since the
visible names are symlinks through them.

Bad files are reported (nodeagent.pods.sources.problems) once per distinct content or error,
and never take a running pod away: the last good version of that file's pod stays
until the file is fixed or deleted. Bad includes: malformed, not a Pod, over
`max_bytes` (1 MiB; refused from its size before it is read), not a regular file (a
FIFO, a device; a directory that replaces a manifest), a symlink loop, unreadable.

Security (what a host-level agent must not be talked into):
- a world-writable folder is refused: reported, and nothing is read from it. At start
  that means no static pods from it; while running, the pods already loaded from it
  (read while it was safe) keep running and nothing new is read until the folder is
  fixed. Stopping them would let whoever can chmod the folder stop node services, and
  reading it would let anyone on the host start them;
- a world-writable manifest file is refused like a bad file (its last good version
  stays);
- symlinks are followed only within the folder (the `..data` swap of a ConfigMap
  mount stays inside it); one that resolves outside is refused like a bad file;
- a manifest with a host namespace (hostNetwork/hostPID/hostIPC) or a privileged
  container is refused unless `allow_privileged` (the agent's `allowPrivileged`).

A file whose content keeps changing does not restart its pod at every write: after a
change is applied, the next one is held for `min_hold` seconds, doubling (up to
`max_hold`) while the file keeps changing, and the latest content is applied when the
hold ends (nodepulse_source_file_changes_held_total counts the holds).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import inotify_simple as ino
from prometheus_client import Counter

from nodeagent.api.clock import Clock
from nodeagent.pods.podupdate import Pod, Source, pod_full_name, pod_uid
from nodeagent.pods.sources import sourcemetrics
from nodeagent.pods.sources.merge import Merge
from nodeagent.pods.sources.static import (
    MAX_MANIFEST_BYTES,
    ManifestError,
    check_host_access,
    make_static_pod,
    parse_manifest,
    static_uid,
)

log = logging.getLogger("nodeagent.pods.sources")

_IGNORED_SUFFIXES = ("~", ".swp", ".swo", ".swx", ".swpx", ".tmp", ".bak", ".part",
                     ".orig", ".rej", ".dpkg-new", ".dpkg-old", ".dpkg-dist")
_WATCH = (ino.flags.CREATE | ino.flags.CLOSE_WRITE | ino.flags.MOVED_TO | ino.flags.MOVED_FROM
          | ino.flags.DELETE | ino.flags.ATTRIB | ino.flags.DELETE_SELF | ino.flags.MOVE_SELF)


CHANGES_HELD = Counter(
    "nodepulse_source_file_changes_held_total",
    "Manifest file changes not applied yet because the file changes too often "
    "(applied when the hold ends).")


def ignored(name: str) -> bool:
    return (name.startswith((".", "#")) or name.endswith(_IGNORED_SUFFIXES)
            or name == "4913")


@dataclass
class _Entry:
    digest: bytes | None = None   # of the raw bytes last parsed (None: never read)
    pod: Pod | None = None        # last good pod from this file
    error: str | None = None      # current problem, already reported
    shadowed_by: str | None = None  # duplicate pod name: the file that owns it
    changed_at: float = float("-inf")  # when its pod last changed (clock.monotonic)
    hold: float = 0.0               # the next change waits until changed_at + hold


class FileSource:
    max_bytes = MAX_MANIFEST_BYTES
    min_hold = 1.0  # a file changing again sooner is held (see the module docstring)

    def __init__(self, path: str | os.PathLike[str], node_name: str, merge: Merge,
                 clock: Clock, *, check_frequency: float = 20.0, debounce: float = 0.1,
                 allow_privileged: bool = False) -> None:
        """Problems are reported through the merge's (merge.problems)."""
        self.path = Path(path)
        self.node_name = node_name
        self.merge = merge
        self.clock = clock
        self.problems = merge.problems
        self.check_frequency = check_frequency
        self.debounce = debounce
        self.allow_privileged = allow_privileged
        self.max_hold = check_frequency  # a held change waits no longer than a rescan
        self._held: dict[str, float] = {}  # file -> when its held change may apply
        self._entries: dict[str, _Entry] = {}
        self._owner: dict[str, str] = {}   # pod full name -> file that delivers it
        self._published: dict[str, Pod] = {}  # uid -> pod, to reuse identical pods
        self._pending: set[str] = set()
        self._full = False
        self._wake = asyncio.Event()
        self._inotify: ino.INotify | None = None
        self._dir_problem: str | None = None
        self.batches = 0
        self._batch_cond = asyncio.Condition()
        self.debouncing = asyncio.Event()  # set while collecting a batch (tests)

    # -- loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._watch(loop)
            self._scan_all("initial")
            next_rescan = self.clock.monotonic() + self.check_frequency
            while True:
                until = min([next_rescan, *self._held.values()])
                woke = await self._wait(max(0.0, until - self.clock.monotonic()))
                if woke and self.debounce > 0:
                    self.debouncing.set()
                    await self.clock.sleep(self.debounce)
                    self.debouncing.clear()
                self._wake.clear()
                names, full = self._pending, self._full
                self._pending, self._full = set(), False
                now = self.clock.monotonic()
                due = [n for n, t in self._held.items() if t <= now]
                for n in due:
                    del self._held[n]  # _load holds it again if it is still too soon
                if now >= next_rescan:
                    if self._inotify is None:
                        self._watch(loop)
                    self._scan_all("rescan")
                    next_rescan = self.clock.monotonic() + self.check_frequency
                elif full:
                    self._scan_all("inotify")
                else:
                    sourcemetrics.FILE_SCANS.labels("inotify" if names else "hold").inc()
                    if self._folder_secure():
                        for name in sorted(names | set(due)):
                            self._load(name)
                    self._publish()
                await self._batch_done()
        finally:
            self._unwatch(loop)

    async def wait_batches(self, n: int) -> None:
        """Return once `n` batches (inotify or rescan passes) have been processed."""
        async with self._batch_cond:
            await self._batch_cond.wait_for(lambda: self.batches >= n)

    async def _batch_done(self) -> None:
        async with self._batch_cond:
            self.batches += 1
            self._batch_cond.notify_all()

    async def _wait(self, timeout: float) -> bool:
        """True when inotify woke us, False when the rescan period ran out."""
        if self._wake.is_set():
            return True
        waker = asyncio.ensure_future(self._wake.wait())
        sleeper = asyncio.ensure_future(self.clock.sleep(timeout))
        done, pending = await asyncio.wait({waker, sleeper},
                                           return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()
        return waker in done

    # -- inotify ------------------------------------------------------------------------

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        fd = ino.INotify(nonblocking=True)
        try:
            fd.add_watch(self.path, _WATCH)
        except OSError as e:
            fd.close()
            self._report_dir(f"cannot watch manifest folder {self.path}: {e.strerror}")
            return
        self._inotify = fd
        loop.add_reader(fd.fileno(), self._on_readable)

    def _unwatch(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._inotify is not None:
            loop.remove_reader(self._inotify.fileno())
            self._inotify.close()
            self._inotify = None

    def _on_readable(self) -> None:
        assert self._inotify is not None
        try:
            events = self._inotify.read(timeout=0)
        except BlockingIOError:
            return
        sourcemetrics.FILE_INOTIFY.inc(len(events))
        for ev in events:
            if ev.mask & (ino.flags.Q_OVERFLOW | ino.flags.DELETE_SELF | ino.flags.MOVE_SELF
                          | ino.flags.IGNORED):
                self._full = True
                if ev.mask & (ino.flags.DELETE_SELF | ino.flags.MOVE_SELF | ino.flags.IGNORED):
                    # the folder itself went away: watch it again on the next rescan
                    self._unwatch(asyncio.get_running_loop())
                    self._wake.set()
                    return
            elif not ev.name:
                if not ev.mask & ino.flags.ATTRIB:
                    continue
                self._full = True  # the folder's own mode changed: look at it again
            elif ev.name.startswith(".."):
                self._full = True
            elif ev.name and not ignored(ev.name):
                if ev.mask & ino.flags.CREATE and not (self.path / ev.name).is_symlink():
                    continue  # a regular file being written: wait for its close_write
                self._pending.add(ev.name)
            else:
                continue
            self._wake.set()

    # -- scanning -----------------------------------------------------------------------

    def _scan_all(self, trigger: str) -> None:
        sourcemetrics.FILE_SCANS.labels(trigger).inc()
        try:
            names = {e.name for e in os.scandir(self.path) if not ignored(e.name)}
        except OSError as e:
            self._report_dir(f"cannot read manifest folder {self.path}: {e.strerror}")
            names = set()
            # A missing folder means no static pods (the kubelet does the same).
        else:
            if not self._folder_secure():
                self._publish()  # what was loaded while it was safe stays (see above)
                return
            self._dir_problem = None
        for name in sorted(names | self._entries.keys()):
            self._load(name)
        self._publish()

    def _folder_secure(self) -> bool:
        """False (reported) when the folder is world-writable: then nothing is read."""
        try:
            mode = os.stat(self.path).st_mode
        except OSError:
            return True  # missing or unreadable: the scan reports that
        if not mode & stat.S_IWOTH:
            if self._dir_problem is not None and "world-writable" in self._dir_problem:
                log.info("file source: %s is no longer world-writable", self.path)
                self._dir_problem = None
            return True
        self._report_dir(f"manifest folder {self.path} is world-writable (mode "
                         f"{stat.S_IMODE(mode):04o}): refused, anyone on the host could "
                         f"add a pod; nothing is read from it until `chmod o-w {self.path}`"
                         " (pods already loaded from it keep running)", "FolderInsecure")
        return False

    def _report_dir(self, message: str, reason: str = "FolderUnreadable") -> None:
        if message != self._dir_problem:
            self._dir_problem = message
            self.problems.report(Source.FILE, reason, message)

    def _load(self, name: str) -> None:
        """Look at one file name and update its entry."""
        path = self.path / name
        entry = self._entries.get(name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if not path.is_symlink():
                self._entries.pop(name, None)  # deleted: its pod goes
                return
            self._fail(name, "broken symlink: its target does not exist", "Unreadable")
            return
        except OSError as e:
            self._fail(name, _oserror(e), "Unreadable")
            return
        if stat.S_ISDIR(st.st_mode):
            if entry is not None and entry.pod is not None:
                self._fail(name, "is now a directory, not a manifest file", "Unreadable")
            else:
                self._entries.pop(name, None)  # subdirectories are not manifests
            return
        if not stat.S_ISREG(st.st_mode):
            self._fail(name, f"not a regular file (a {_kind(st.st_mode)})", "Unreadable")
            return
        real = os.path.realpath(path)
        root = os.path.realpath(self.path)
        if os.path.commonpath([root, real]) != root:
            self._fail(name, f"a symlink to {real}, outside the manifest folder: refused "
                       "(symlinks are followed only within the folder)", "Insecure")
            return
        try:
            data = self._read(Path(real))
        except ManifestError as e:
            self._fail(name, e.problem, e.reason)
            return
        except FileNotFoundError:
            return  # replaced while we looked (a ConfigMap swap): its own events follow
        except OSError as e:
            self._fail(name, _oserror(e), "Unreadable")
            return
        digest = hashlib.blake2b(data, digest_size=16).digest()
        if entry is not None and entry.digest == digest:
            return  # same bytes as last time: nothing to parse, nothing to report
        if entry is None:
            entry = self._entries[name] = _Entry()
        entry.digest = digest
        try:
            doc = parse_manifest(data, name)
            if not self.allow_privileged:
                check_host_access(doc, name)
            uid = static_uid(doc, Source.FILE, self.node_name)
            pod = self._published.get(uid)
            if pod is None and entry.pod is not None and pod_uid(entry.pod) == uid:
                pod = entry.pod
            if pod is None:
                pod = make_static_pod(doc, Source.FILE, self.node_name, self.clock.now())
        except ManifestError as e:
            self._fail(name, e.problem, e.reason, parsed=True)
            return
        if entry.pod is not pod and not self._may_change(name, entry):
            entry.digest = None  # read it again when the hold ends
            return
        if entry.error is not None:
            log.info("file source: %s is good again", path)
        entry.error = None
        entry.pod = pod

    def _may_change(self, name: str, entry: _Entry) -> bool:
        """Whether the file's pod may change now; if not, the change is held (and the
        file looked at again when the hold ends). Each change applied soon after the
        previous one doubles the hold, from min_hold to max_hold."""
        now = self.clock.monotonic()
        due = entry.changed_at + entry.hold
        if now < due:
            CHANGES_HELD.inc()
            self._held[name] = due
            return False
        if now - entry.changed_at < max(self.min_hold, 2 * entry.hold):
            if entry.hold == 0:
                self.problems.report(
                    Source.FILE, "Flapping",
                    f"{self.path / name}: changes more often than every {self.min_hold:g}s; "
                    f"further changes are held (the hold doubles up to {self.max_hold:g}s "
                    "while it keeps changing) and the latest content is applied when the "
                    "hold ends")
            entry.hold = min(self.max_hold, max(self.min_hold, entry.hold * 2))
        else:
            entry.hold = 0.0
        entry.changed_at = now
        return True

    def _read(self, path: Path) -> bytes:
        # O_NOFOLLOW: `path` is resolved; a symlink put in its place since is refused
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ManifestError(path.name, f"not a regular file (a {_kind(st.st_mode)})",
                                    "Unreadable")
            if st.st_mode & stat.S_IWOTH:
                raise ManifestError(path.name, f"world-writable (mode "
                                    f"{stat.S_IMODE(st.st_mode):04o}): refused, anyone on "
                                    "the host could change it; chmod o-w it", "Insecure")
            if st.st_size > self.max_bytes:
                raise ManifestError(path.name, f"{st.st_size} bytes, over the limit of "
                                    f"{self.max_bytes} bytes", "TooLarge")
            chunks = []
            size = 0
            while size <= self.max_bytes:
                chunk = os.read(fd, self.max_bytes + 1 - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            if size > self.max_bytes:
                raise ManifestError(path.name, f"over the limit of {self.max_bytes} bytes",
                                    "TooLarge")
            return b"".join(chunks)
        finally:
            os.close(fd)

    def _fail(self, name: str, problem: str, reason: str, parsed: bool = False) -> None:
        entry = self._entries.setdefault(name, _Entry())
        if not parsed:
            entry.digest = None  # not read: look again next time (reported once, below)
        if entry.error == problem:
            return
        entry.error = problem
        kept = ""
        if entry.pod is not None:
            kept = f"; keeping the last good version of pod {pod_full_name(entry.pod)}"
        self.problems.report(Source.FILE, reason, f"{self.path / name}: {problem}{kept}")

    def _publish(self) -> None:
        """Resolve duplicate pod names between files and hand the set to the merge."""
        claims: dict[str, list[str]] = {}
        for fname, entry in self._entries.items():
            if entry.pod is not None:
                claims.setdefault(pod_full_name(entry.pod), []).append(fname)
        owner: dict[str, str] = {}
        pods: list[Pod] = []
        for pname, files in claims.items():
            incumbent = self._owner.get(pname)
            win = incumbent if incumbent in files else min(files)
            owner[pname] = win
            pods.append(self._entries[win].pod)  # type: ignore[arg-type]
            for f in files:
                e = self._entries[f]
                if f == win:
                    e.shadowed_by = None
                elif e.shadowed_by != win:
                    e.shadowed_by = win
                    self.problems.report(
                        Source.FILE, "Duplicate",
                        f"{self.path / f}: pod {pname} is already defined by "
                        f"{self.path / win}; {f} is ignored until that is resolved")
        self._owner = owner
        self._published = {pod_uid(p): p for p in pods}
        self.merge.set(Source.FILE, pods)


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISDIR, "directory")):
        if test(mode):
            return kind
    return "special file"


def _oserror(e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "symlink loop (too many levels of symbolic links)"
    if e.errno == errno.EACCES:
        return "unreadable: permission denied"
    return f"unreadable: {e.strerror or e}"
