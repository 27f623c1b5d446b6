"""The system D-Bus, the one module that speaks it: systemd-logind for graceful node
shutdown (nodeagent.shutdown), and systemd's manager for the systemd cgroup driver's
slices (nodeagent.pods.systemdcgroups). dbus-fast does the wire protocol, the
authentication and the file descriptor a reply carries (docs/architecture.md says why).

The bus is found where the kubelet's D-Bus library finds it: $DBUS_SYSTEM_BUS_ADDRESS,
else the system bus socket.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.errors import DBusFastError

from nodeagent.pods.cgroups import CgroupError
from nodeagent.pods.systemdcgroups import UnitProperty
from nodeagent.shutdown import LogindError

log = logging.getLogger(__name__)

SYSTEM_BUS = "unix:path=/var/run/dbus/system_bus_socket"
LOGIND = "org.freedesktop.login1"
LOGIND_PATH = "/org/freedesktop/login1"
MANAGER = "org.freedesktop.login1.Manager"
SYSTEMD = "org.freedesktop.systemd1"
SYSTEMD_PATH = "/org/freedesktop/systemd1"
SYSTEMD_MANAGER = "org.freedesktop.systemd1.Manager"
DBUS = "org.freedesktop.DBus"
SIGHUP = 1  # what makes logind read its configuration again
# a match rule for the one signal the agent waits for
SHUTDOWN_SIGNAL = (f"type='signal',sender='{LOGIND}',interface='{MANAGER}',"
                   f"member='PrepareForShutdown',path='{LOGIND_PATH}'")
JOB_REMOVED = (f"type='signal',sender='{SYSTEMD}',interface='{SYSTEMD_MANAGER}',"
               f"member='JobRemoved',path='{SYSTEMD_PATH}'")
JOB_TIMEOUT = 30.0  # seconds a slice's start or stop may take (the kubelet's wait too)
RECENT_JOBS = 256   # finished jobs remembered until their caller reads their reply
# D-Bus errors are Python exceptions of these kinds: the bus could not be reached, it
# went away, or the other side answered with an error
_FAILURES = (OSError, EOFError, DBusFastError)


def system_bus_address(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return env.get("DBUS_SYSTEM_BUS_ADDRESS") or SYSTEM_BUS


class LogindBus:
    """One connection to the system bus, watching logind's PrepareForShutdown signal
    from the start (see nodeagent.shutdown.Logind)."""

    def __init__(self, bus: MessageBus, address: str) -> None:
        self.bus = bus
        self.address = address
        # PrepareForShutdown's argument, or None once the connection is gone
        self._signals: asyncio.Queue[bool | None] = asyncio.Queue()
        bus.add_message_handler(self._message)
        self._gone = asyncio.ensure_future(self._watch_connection())

    @classmethod
    async def connect(cls, address: str | None = None) -> LogindBus:
        address = address or system_bus_address()
        try:
            bus = await MessageBus(bus_address=address, bus_type=BusType.SYSTEM,
                                   negotiate_unix_fd=True).connect()
        except _FAILURES as e:
            raise LogindError(f"cannot connect to the system bus at {address}: "
                              f"{_brief(e)}") from None
        self = cls(bus, address)
        try:
            await self._call(DBUS, "/org/freedesktop/DBus", DBUS, "AddMatch", "s",
                             [SHUTDOWN_SIGNAL])
        except LogindError:
            self.close()
            raise
        return self

    async def _watch_connection(self) -> None:
        with contextlib.suppress(*_FAILURES):
            await self.bus.wait_for_disconnect()
        self._signals.put_nowait(None)

    def _message(self, msg: Message) -> bool:
        if (msg.message_type == MessageType.SIGNAL and msg.interface == MANAGER
                and msg.member == "PrepareForShutdown" and msg.path == LOGIND_PATH):
            if msg.signature == "b":
                self._signals.put_nowait(bool(msg.body[0]))
            else:
                log.warning("logind: PrepareForShutdown with arguments %r, not one "
                            "boolean; ignored", msg.signature)
        return False  # others may want it too (the library's replies)

    async def _call(self, destination: str, path: str, interface: str, member: str,
                    signature: str = "", body: list[Any] | None = None) -> Message:
        try:
            return await _call(self.bus, destination, path, interface, member, signature,
                               body)
        except _BusError as e:
            raise LogindError(f"{interface}.{member}: {e}") from None

    async def inhibit_delay_max(self) -> float:
        reply = await self._call(LOGIND, LOGIND_PATH, "org.freedesktop.DBus.Properties",
                                 "Get", "ss", [MANAGER, "InhibitDelayMaxUSec"])
        variant = reply.body[0]
        if variant.signature != "t":
            raise LogindError(f"logind's InhibitDelayMaxUSec is of type "
                              f"{variant.signature}, not t (a uint64)")
        return int(variant.value) / 1e6

    async def inhibit(self, what: str, who: str, why: str, mode: str) -> int:
        reply = await self._call(LOGIND, LOGIND_PATH, MANAGER, "Inhibit", "ssss",
                                 [what, who, why, mode])
        fds = list(reply.unix_fds)
        if reply.signature != "h" or not fds or not 0 <= reply.body[0] < len(fds):
            for fd in fds:
                os.close(fd)
            raise LogindError(f"{MANAGER}.Inhibit: the reply carried no file descriptor "
                              f"(signature {reply.signature!r}, {len(fds)} fds)")
        lock = fds.pop(reply.body[0])
        for fd in fds:
            os.close(fd)
        return lock

    async def reload(self) -> None:
        await self._call(SYSTEMD, SYSTEMD_PATH, SYSTEMD_MANAGER, "KillUnit", "ssi",
                         ["systemd-logind.service", "all", SIGHUP])

    async def prepare_for_shutdown(self) -> bool:
        active = await self._signals.get()
        if active is None:
            self._signals.put_nowait(None)  # the next reader learns it too
            raise LogindError(f"the system bus connection ({self.address}) was closed")
        return active

    def close(self) -> None:
        self._gone.cancel()
        self.bus.disconnect()


class _BusError(Exception):
    """A call failed: the bus could not be reached or went away (`name` empty), or the
    other side answered with the D-Bus error `name`."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


async def _call(bus: MessageBus, destination: str, path: str, interface: str, member: str,
                signature: str = "", body: list[Any] | None = None) -> Message:
    """One method call and its reply. Raises _BusError."""
    try:
        reply = await bus.call(Message(destination=destination, path=path,
                                       interface=interface, member=member,
                                       signature=signature, body=body or []))
    except _FAILURES as e:
        raise _BusError("", _brief(e)) from None
    if reply.message_type == MessageType.ERROR:
        detail = reply.body[0] if reply.body else ""
        raise _BusError(reply.error_name or "", f"{reply.error_name}: {detail}")
    return reply


def _brief(e: BaseException) -> str:
    return str(e) or type(e).__name__


T = TypeVar("T")


class SystemdUnits:
    """systemd's manager on the system bus, as the systemd cgroup driver uses it
    (nodeagent.pods.systemdcgroups.SliceManager): transient slices started with their
    properties, changed and stopped, each call waiting until systemd's job is done.

    The calls block, as the cgroup files written beside them do. The connection has a
    thread and an event loop of its own, so a call made on the agent's loop does not
    wait for that same loop. Failures raise CgroupError naming the unit."""

    def __init__(self, address: str, timeout: float = JOB_TIMEOUT) -> None:
        self.address = address
        self.timeout = timeout
        self.bus: MessageBus | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="systemd-bus",
                                        daemon=True)
        self._thread.start()
        # JobRemoved is sent for every job on the host: results are kept only for the
        # jobs waited for, and a bounded few that finish before their reply is read
        self._waiting: dict[str, asyncio.Future[str]] = {}
        self._finished: OrderedDict[str, str] = OrderedDict()

    @classmethod
    def connect(cls, address: str | None = None, timeout: float = JOB_TIMEOUT
                ) -> SystemdUnits:
        self = cls(address or system_bus_address(), timeout)
        try:
            self._run(self._connect())
        except CgroupError:
            self.close()
            raise
        return self

    async def _connect(self) -> None:
        try:
            bus = await MessageBus(bus_address=self.address,
                                   bus_type=BusType.SYSTEM).connect()
        except _FAILURES as e:
            raise CgroupError(f"cannot connect to the system bus at {self.address}: "
                              f"{_brief(e)}") from None
        if self.bus is not None:
            log.info("systemd: connected to the system bus again (%s)", self.address)
        self.bus = bus
        bus.add_message_handler(self._message)
        await self._call(DBUS, "/org/freedesktop/DBus", DBUS, "AddMatch", "s", [JOB_REMOVED])
        # systemd sends its manager's signals only once some client has subscribed
        await self._call(SYSTEMD, SYSTEMD_PATH, SYSTEMD_MANAGER, "Subscribe")

    def _run(self, coro: Coroutine[Any, Any, T], what: str = "") -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        prefix = f"{what}: " if what else ""
        try:
            return future.result(self.timeout + 5)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise CgroupError(f"{prefix}systemd did not answer within "
                              f"{self.timeout + 5:.0f} s (bus {self.address})") from None
        except CgroupError as e:
            raise CgroupError(f"{prefix}{e}") from None

    def _message(self, msg: Message) -> bool:
        if (msg.message_type == MessageType.SIGNAL and msg.member == "JobRemoved"
                and msg.interface == SYSTEMD_MANAGER and msg.signature == "uoss"):
            _, job, _, result = msg.body
            waiter = self._waiting.pop(job, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(result)
            else:
                self._finished[job] = result
                while len(self._finished) > RECENT_JOBS:
                    self._finished.popitem(last=False)
        return False

    async def _call(self, destination: str, path: str, interface: str, member: str,
                    signature: str = "", body: list[Any] | None = None) -> Message:
        if self.bus is None or not self.bus.connected:
            # the bus went away (dbus-daemon restarted): connect again, once per call
            await self._connect()
            assert self.bus is not None
        try:
            return await _call(self.bus, destination, path, interface, member, signature,
                               body)
        except _BusError as e:
            raise _UnitError(e.name, f"{member}: {e}") from None

    async def _job(self, member: str, signature: str, body: list[Any]) -> None:
        """Call a manager method that queues a job, and wait for the job's end."""
        reply = await self._call(SYSTEMD, SYSTEMD_PATH, SYSTEMD_MANAGER, member,
                                 signature, body)
        job = str(reply.body[0])
        result = self._finished.pop(job, None)
        if result is None:
            waiter = self._loop.create_future()
            self._waiting[job] = waiter
            try:
                result = await asyncio.wait_for(waiter, self.timeout)
            except TimeoutError:
                raise CgroupError(f"{member}: its job {job} did not end within "
                                  f"{self.timeout:.0f} s") from None
            finally:
                self._waiting.pop(job, None)
        if result != "done":
            raise CgroupError(f"{member}: its job ended {result!r}")

    async def _start_slice(self, name: str, properties: Sequence[UnitProperty]) -> None:
        try:
            await self._job("StartTransientUnit", "ssa(sv)a(sa(sv))",
                            [name, "replace", _variants(properties), []])
        except _UnitError as e:
            if e.name != "org.freedesktop.systemd1.UnitExists":
                raise
            # there from before (the agent restarted): it gets these values instead
            await self._set(name, [p for p in properties if p[0] not in _START_ONLY])

    async def _set(self, name: str, properties: Sequence[UnitProperty]) -> None:
        await self._call(SYSTEMD, SYSTEMD_PATH, SYSTEMD_MANAGER, "SetUnitProperties",
                         "sba(sv)", [name, True, _variants(properties)])

    async def _stop(self, name: str) -> None:
        try:
            await self._job("StopUnit", "ss", [name, "replace"])
        except _UnitError as e:
            if e.name != "org.freedesktop.systemd1.NoSuchUnit":
                raise

    def start_slice(self, name: str, properties: Sequence[UnitProperty]) -> None:
        self._run(self._start_slice(name, properties), f"starting {name}")

    def set_properties(self, name: str, properties: Sequence[UnitProperty]) -> None:
        self._run(self._set(name, properties), f"setting {name}'s properties")

    def stop(self, name: str) -> None:
        self._run(self._stop(name), f"stopping {name}")

    def close(self) -> None:
        if self.bus is not None:
            self._loop.call_soon_threadsafe(self.bus.disconnect)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()


class _UnitError(CgroupError):
    """systemd answered with a D-Bus error; `name` is the error's name."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


# what a unit takes only when it is made, not from SetUnitProperties
_START_ONLY = frozenset({"DefaultDependencies"})


def _variants(properties: Sequence[UnitProperty]) -> list[list[Any]]:
    return [[name, Variant(signature, value)] for name, signature, value in properties]
