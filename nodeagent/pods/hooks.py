"""Container lifecycle as the kubelet runs it around start and stop: postStart and
preStop hooks (exec, httpGet, sleep), termination messages, and the pod's
activeDeadlineSeconds.

- postStart runs right after the container starts; if it fails the container is killed
  (Warning `FailedPostStartHook`) and restarted as its restart policy says.
- preStop runs before a container is stopped, within the grace period (what it uses is
  taken from the grace the container then gets; Warning `FailedPreStopHook` when it
  fails). Neither hook's output goes into an Event (it may hold secrets).
- Termination messages: each container attempt gets a file of its own on the host,
  `<pods dir>/<pod uid>/containers/<name>/termination-<attempt>`, mounted at its
  `terminationMessagePath`; when the container exits the last 4096 bytes of it are its
  `state.terminated.message`, or with `FallbackToLogsOnError` and a failure, when the
  file is empty, the last 80 lines (2048 bytes) of its log.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from nodeagent.api.clock import Clock, clock_timeout
from nodeagent.events import NORMAL, WARNING, Events
from nodeagent.pods.handlers import FAILURE, ActionError, Actions, Target, handler_kind
from nodeagent.pods.podupdate import Pod
from nodeagent.runtime.base import Container, ContainerRuntimeError, Mount
from nodeagent.runtime.logfile import BLOCK, Formatter, LogOptions, tail_offset

log = logging.getLogger(__name__)

MAX_MESSAGE = 4096          # bytes of a container's termination message
MAX_POD_MESSAGES = 12 * 1024  # bytes of all of a pod's, shared by its containers
LOG_LINES, LOG_BYTES = 80, 2048  # FallbackToLogsOnError: the end of the log
DEADLINE_REASON = "DeadlineExceeded"
DEADLINE_MESSAGE = "Pod was active on the node longer than the specified deadline"
MIN_GRACE = 2.0  # a container always gets this long to stop after its preStop hook


def pod_label(pod: Pod) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('name')}_{meta.get('namespace', 'default')}({meta.get('uid')})"


class Hooks:
    """Runs a container's postStart and preStop handlers."""

    def __init__(self, actions: Actions, clock: Clock, events: Events | None = None) -> None:
        self.actions = actions
        self.clock = clock
        self.events = events

    def _event(self, pod: Pod, container: str, type_: str, reason: str, msg: str) -> None:
        if self.events is not None:
            self.events.pod(pod, type_, reason, msg, container=container)

    async def run(self, pod: Pod, container: Mapping[str, Any], handler: Mapping[str, Any],
                  target: Target) -> str | None:
        """Run one hook handler to its end; the kubelet's error message if it failed."""
        name = container["name"]
        kind = handler_kind(handler)
        where = f'for Container "{name}" in Pod "{pod_label(pod)}"'
        try:
            if kind == "exec":
                cmd = [str(x) for x in (handler["exec"] or {}).get("command") or []]
                try:
                    r = await self.actions.runtime.exec_sync(target.container_id, cmd, 0)
                except ContainerRuntimeError as e:
                    return f"Exec lifecycle hook ([{' '.join(cmd)}]) {where} failed - " \
                           f'error: {e}, message: ""'
                if r.exit_code != 0:
                    out = (r.stdout + r.stderr).decode(errors="replace")
                    return f"Exec lifecycle hook ([{' '.join(cmd)}]) {where} failed - " \
                           f"error: command '{' '.join(cmd)}' exited with {r.exit_code}: " \
                           f'{out}, message: "{out}"'
                return None
            if kind == "httpGet":
                action = handler["httpGet"]
                outcome = await self.actions.http_get(action, target, 0, purpose="lifecycle",
                                                      any_status=True)
                if outcome.result == FAILURE and str(action.get("scheme")).upper() == \
                        "HTTPS" and "WRONG_VERSION_NUMBER" in outcome.output:
                    # the server speaks plain HTTP: the kubelet retries with it, and says so
                    plain = await self.actions.http_get({**action, "scheme": "HTTP"}, target,
                                                        0, purpose="lifecycle",
                                                        any_status=True)
                    if plain.result != FAILURE:
                        url = self.actions.http_url(action, target)
                        self._event(pod, "", WARNING, "LifecycleHTTPFallback",
                                    f"request to HTTPS lifecycle hook {url.host}:{url.port} "
                                    "got HTTP response, retry with HTTP succeeded")
                        outcome = plain
                if outcome.result == FAILURE:
                    return f"HTTP lifecycle hook ({action.get('path', '')}) {where} failed - " \
                           f"error: {outcome.output}"
                return None
            if kind == "sleep":
                await self.clock.sleep(float((handler["sleep"] or {}).get("seconds") or 0))
                return None
        except ActionError as e:
            return f"Cannot run handler: {e}"
        return f"Cannot run handler: invalid handler: {sorted(handler)}"

    async def post_start(self, pod: Pod, container: Mapping[str, Any],
                         target: Target) -> str | None:
        """None when it worked (or there is none); else the error, and the Event."""
        handler = ((container.get("lifecycle") or {}).get("postStart"))
        if not handler:
            return None
        msg = await self.run(pod, container, handler, target)
        if msg is not None:
            log.info("pod %s: %s", pod_label(pod), msg)
            self._event(pod, container["name"], WARNING, "FailedPostStartHook",
                        "PostStartHook failed")
        return msg

    async def pre_stop(self, pod: Pod, container: Mapping[str, Any], target: Target,
                       grace: float) -> float:
        """Run the preStop hook for at most `grace` seconds; the grace left for the stop
        itself (at least MIN_GRACE)."""
        handler = ((container.get("lifecycle") or {}).get("preStop"))
        if not handler or grace <= 0:
            return max(grace, MIN_GRACE)
        started = self.clock.monotonic()
        try:
            msg = await clock_timeout(self.clock, self.run(pod, container, handler, target),
                                      grace, "preStop hook")
        except TimeoutError:
            log.info("pod %s container %s: preStop hook not done within %.0fs",
                     pod_label(pod), container["name"], grace)
            msg = None
        if msg is not None:
            log.info("pod %s: %s", pod_label(pod), msg)
            self._event(pod, container["name"], WARNING, "FailedPreStopHook",
                        "PreStopHook failed")
        used = int(self.clock.monotonic() - started)  # whole seconds, as the kubelet
        return max(grace - used, MIN_GRACE)

    def killing(self, pod: Pod, container: str, message: str) -> None:
        self._event(pod, container, NORMAL, "Killing", message)


# --- termination messages -------------------------------------------------------------

def message_file(pods_dir: str, uid: str, name: str, attempt: int) -> str:
    return os.path.join(pods_dir, uid, "containers", name, f"termination-{attempt}")


def termination_mount(pods_dir: str, pod: Pod, container: Mapping[str, Any],
                      attempt: int) -> Mount | None:
    """Create the (empty, world-writable: the container may run as any user) file the
    container's terminationMessagePath is mounted from."""
    path = str(container.get("terminationMessagePath") or "")
    if not path or not pods_dir:
        return None
    host = message_file(pods_dir, str(pod["metadata"]["uid"]), str(container["name"]),
                        attempt)
    os.makedirs(os.path.dirname(host), exist_ok=True)
    with open(host, "wb"):
        pass
    os.chmod(host, 0o666)
    return Mount(container_path=path, host_path=host)


def _tail(path: str, limit: int) -> bytes:
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - limit))
        return f.read(limit)


def log_tail(path: str, fmt: str) -> str:
    """The last LOG_LINES lines of a container's log (at most LOG_BYTES, the end)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(tail_offset(f, LOG_LINES, size))
            raw = f.read(min(size, LOG_LINES * BLOCK))
    except OSError as e:
        return f"Error on reading termination message from logs: {e}"
    out = bytearray()
    formatter = Formatter(fmt, LogOptions())
    for line in raw.splitlines(keepends=True):
        formatter.line(line, out)
    return bytes(out[-LOG_BYTES:]).decode(errors="replace")


def termination_message(pods_dir: str, pod: Pod, container: Mapping[str, Any],
                        c: Container, log_format: str) -> str:
    """What an exited container leaves as its message (see the module docstring)."""
    fallback = (container.get("terminationMessagePolicy") == "FallbackToLogsOnError"
                and (c.exit_code or 0) != 0 and c.reason != "ContainerCannotRun")
    text = ""
    if container.get("terminationMessagePath") and pods_dir:
        path = message_file(pods_dir, c.pod_uid, c.name, c.attempt)
        try:
            text = _tail(path, MAX_MESSAGE).decode(errors="replace")
        except FileNotFoundError:
            text = ""
        except OSError as e:
            return f"Error on reading termination log {path}: {e}"
    if not text and fallback and c.log_path:
        text = log_tail(c.log_path, log_format)
    return text


def cap_messages(messages: dict[str, str], containers: int) -> dict[str, str]:
    """Each message cut to its share of the pod's MAX_POD_MESSAGES."""
    share = MAX_POD_MESSAGES // max(1, containers)
    return {cid: m.encode()[:share].decode(errors="ignore") for cid, m in messages.items()}
