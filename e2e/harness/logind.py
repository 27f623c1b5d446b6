"""A private D-Bus (Debian's dbus-daemon) with a stand-in for systemd-logind on it, for
the graceful node shutdown test: the agent finds the bus through
$DBUS_SYSTEM_BUS_ADDRESS, as it would find the host's system bus.

The stand-in answers what the agent (or `systemd-inhibit --list`) asks of logind, over
the real protocol, with dbus-fast's message-level API:

- org.freedesktop.login1.Manager.Inhibit(what, who, why, mode) -> h: a pipe's write end
  (as logind hands a FIFO's); when every copy of it is closed, the read end sees end of
  file and the lock is released;
- ListInhibitors -> a(ssssuu), the InhibitDelayMaxUSec property (Properties.Get);
- the PrepareForShutdown(b) signal, sent on SIGUSR1 (true) and SIGUSR2 (false);
- org.freedesktop.systemd1.Manager.KillUnit("systemd-logind.service", _, SIGHUP): the
  logind.conf.d folder is read again, as logind reloads it (InhibitDelayMaxSec).

What it sees goes to a JSON-lines record (`t`: CLOCK_BOOTTIME seconds, the clock of
/proc/uptime, so a container's own stamps compare with it). Run as
`python -m e2e.harness.logind --bus ADDRESS --conf-dir DIR --delay-max-sec N --record F`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast.aio import MessageBus

from e2e.harness.waits import eventually
from nodepulse_dev.processes import stop_process

LOGIND, LOGIND_PATH = "org.freedesktop.login1", "/org/freedesktop/login1"
MANAGER = "org.freedesktop.login1.Manager"
SYSTEMD, SYSTEMD_PATH = "org.freedesktop.systemd1", "/org/freedesktop/systemd1"
SYSTEMD_MANAGER = "org.freedesktop.systemd1.Manager"
PROPERTIES = "org.freedesktop.DBus.Properties"
ROOT = Path(__file__).resolve().parents[2]

BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>nodepulse-e2e</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_destination="*"/>
    <allow receive_sender="*"/>
  </policy>
</busconfig>
"""


def boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


# -- the stand-in, in its own process -------------------------------------------------

class StandIn:
    def __init__(self, bus: MessageBus, conf_dir: Path, delay: float, record: Path) -> None:
        self.bus = bus
        self.conf_dir = conf_dir
        self.delay = delay
        self.record_path = record
        self.inhibitors: dict[int, tuple[str, str, str, str, int, int]] = {}  # read fd ->
        self.tasks: set[asyncio.Task[None]] = set()

    def record(self, event: str, **fields: Any) -> None:
        with self.record_path.open("a") as f:
            f.write(json.dumps({"event": event, "t": boottime(), **fields}) + "\n")

    def handle(self, msg: Message) -> Message | bool:
        if msg.message_type != MessageType.METHOD_CALL:
            return False
        call = (msg.interface, msg.member)
        if call == (MANAGER, "Inhibit") and msg.signature == "ssss":
            task = asyncio.ensure_future(self.inhibit(msg))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            return True
        if call == (MANAGER, "ListInhibitors"):
            return Message.new_method_return(msg, "a(ssssuu)",
                                             [[list(i) for i in self.inhibitors.values()]])
        if call == (PROPERTIES, "Get") and msg.body == [MANAGER, "InhibitDelayMaxUSec"]:
            return Message.new_method_return(msg, "v",
                                             [Variant("t", int(self.delay * 1e6))])
        if call == (SYSTEMD_MANAGER, "KillUnit") and msg.body[0] == "systemd-logind.service" \
                and msg.body[2] == signal.SIGHUP:
            self.reload()
            return Message.new_method_return(msg)
        if msg.destination in (LOGIND, SYSTEMD):
            return Message.new_error(msg, "org.freedesktop.DBus.Error.UnknownMethod",
                                     f"the stand-in does not do {msg.interface}."
                                     f"{msg.member}({msg.signature})")
        return False

    def reload(self) -> None:
        """logind.conf.d, read again as logind does on SIGHUP (only what is used)."""
        for path in sorted(self.conf_dir.glob("*.conf")):
            for line in path.read_text().splitlines():
                key, _, value = line.partition("=")
                if key.strip() == "InhibitDelayMaxSec":
                    self.delay = float(value)
        self.record("reload", delay=self.delay)

    async def inhibit(self, msg: Message) -> None:
        what, who, why, mode = msg.body
        pid_reply = await self.bus.call(Message(
            destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus", member="GetConnectionUnixProcessID",
            signature="s", body=[msg.sender]))
        pid = int(pid_reply.body[0])
        r, w = os.pipe()
        await self.bus.send(Message.new_method_return(msg, "h", [0], unix_fds=[w]))
        os.close(w)  # sent: the caller's copy (and its children's) is all that holds it
        self.inhibitors[r] = (what, who, why, mode, os.getuid(), pid)
        self.record("inhibit", what=what, who=who, why=why, mode=mode, pid=pid, lock=r)
        asyncio.get_running_loop().add_reader(r, self.readable, r)

    def readable(self, r: int) -> None:
        if os.read(r, 4096) == b"":  # end of file: every write end is closed
            asyncio.get_running_loop().remove_reader(r)
            os.close(r)
            what, who, *_ = self.inhibitors.pop(r)
            self.record("released", who=who, lock=r)

    def prepare_for_shutdown(self, active: bool) -> None:
        self.record("signal", active=active)
        self.bus.send(Message.new_signal(LOGIND_PATH, MANAGER, "PrepareForShutdown", "b",
                                         [active]))


async def serve(address: str, conf_dir: Path, delay: float, record: Path) -> None:
    bus = await MessageBus(bus_address=address, bus_type=BusType.SYSTEM,
                           negotiate_unix_fd=True).connect()
    stand_in = StandIn(bus, conf_dir, delay, record)
    bus.add_message_handler(stand_in.handle)
    for name in (LOGIND, SYSTEMD):
        await bus.request_name(name)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, stand_in.prepare_for_shutdown, True)
    loop.add_signal_handler(signal.SIGUSR2, stand_in.prepare_for_shutdown, False)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    stand_in.record("ready", delay=delay)
    await stop.wait()
    bus.disconnect()


# -- the test's side -------------------------------------------------------------------

@dataclass
class Logind:
    """The private bus and the stand-in on it, both processes of the test."""
    base: Path
    address: str
    conf_dir: Path
    record_path: Path
    daemon: subprocess.Popen[bytes]
    stand_in: subprocess.Popen[bytes]

    def records(self, event: str | None = None) -> list[dict[str, Any]]:
        lines = self.record_path.read_text().splitlines() if self.record_path.exists() else []
        out = [json.loads(line) for line in lines]
        return [r for r in out if event is None or r["event"] == event]

    def prepare_for_shutdown(self, active: bool) -> None:
        self.stand_in.send_signal(signal.SIGUSR1 if active else signal.SIGUSR2)

    def list_inhibitors(self) -> list[list[Any]]:
        """ListInhibitors, asked over the bus as any client would."""
        async def ask() -> list[list[Any]]:
            bus = await MessageBus(bus_address=self.address, bus_type=BusType.SYSTEM).connect()
            try:
                reply = await bus.call(Message(destination=LOGIND, path=LOGIND_PATH,
                                               interface=MANAGER, member="ListInhibitors"))
                assert reply.message_type == MessageType.METHOD_RETURN, reply.body
                return [list(i) for i in reply.body[0]]
            finally:
                bus.disconnect()
        return asyncio.run(ask())

    def stop(self) -> None:
        for proc in (self.stand_in, self.daemon):
            stop_process(proc, timeout=10)


def start_logind(base: Path, delay_max_sec: float) -> Logind:
    """dbus-daemon on a socket under `base`, the stand-in on it, ready."""
    base.mkdir(parents=True, exist_ok=True)
    socket_path = base / "system_bus_socket"
    (base / "bus.conf").write_text(BUS_CONFIG.format(socket=socket_path))
    conf_dir = base / "logind.conf.d"
    record = base / "logind.jsonl"
    address = f"unix:path={socket_path}"
    log = (base / "dbus-daemon.log").open("wb")
    daemon = subprocess.Popen(["dbus-daemon", f"--config-file={base / 'bus.conf'}",
                               "--nofork", "--nopidfile"], stdout=log, stderr=log,
                              stdin=subprocess.DEVNULL)
    stand_in = None
    try:
        eventually(lambda: socket_path.exists() or daemon.poll() is not None,
                   "dbus-daemon's socket", 10)
        assert daemon.poll() is None, (base / "dbus-daemon.log").read_text()
        stand_in = subprocess.Popen(
            [sys.executable, "-m", "e2e.harness.logind", "--bus", address, "--conf-dir",
             str(conf_dir), "--delay-max-sec", str(delay_max_sec), "--record", str(record)],
            cwd=ROOT, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        it = Logind(base, address, conf_dir, record, daemon, stand_in)
        eventually(lambda: it.records("ready") or stand_in.poll() is not None,
                   "the stand-in logind on the bus", 20)
        assert stand_in.poll() is None, (base / "dbus-daemon.log").read_text()
        return it
    except BaseException:
        for proc in (stand_in, daemon):
            if proc is not None:
                stop_process(proc, timeout=10)
        raise


def iter_stops(path: Path) -> Iterator[tuple[str, float]]:
    """(pod, CLOCK_BOOTTIME seconds) of each line the test pods wrote when asked to stop."""
    if path.exists():
        for line in path.read_text().splitlines():
            name, _, t = line.partition(" ")
            yield name, float(t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bus", required=True)
    parser.add_argument("--conf-dir", required=True, type=Path)
    parser.add_argument("--delay-max-sec", required=True, type=float)
    parser.add_argument("--record", required=True, type=Path)
    a = parser.parse_args()
    asyncio.run(serve(a.bus, a.conf_dir, a.delay_max_sec, a.record))


if __name__ == "__main__":
    main()
