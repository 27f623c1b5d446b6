"""systemd-logind on the system D-Bus, as graceful node shutdown (nodeagent.shutdown)
uses it: the one module that speaks D-Bus. dbus-fast does the wire protocol, the
authentication and the file descriptor a reply carries (docs/architecture.md says why).

The bus is found where the kubelet's D-Bus library finds it: $DBUS_SYSTEM_BUS_ADDRESS,
else the system bus socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping
from typing import Any

from dbus_fast import BusType, Message, MessageType
from dbus_fast.aio import MessageBus
from dbus_fast.errors import DBusFastError

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
            reply = await self.bus.call(Message(destination=destination, path=path,
                                                interface=interface, member=member,
                                                signature=signature, body=body or []))
        except _FAILURES as e:
            raise LogindError(f"{interface}.{member}: {_brief(e)}") from None
        if reply.message_type == MessageType.ERROR:
            detail = reply.body[0] if reply.body else ""
            raise LogindError(f"{interface}.{member}: {reply.error_name}: {detail}")
        return reply

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


def _brief(e: BaseException) -> str:
    return str(e) or type(e).__name__
