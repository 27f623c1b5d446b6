"""A private Docker engine for the kind tests: Debian's dockerd with its own data root,
exec root, socket, pidfile and address pool under one temp folder, stopped by PID.

    from e2e.kind.docker import start_dockerd
    engine = start_dockerd()          # returns when the API answers
    engine.docker("images")           # the docker CLI of the same package, on this engine
    engine.stop()                     # containers, networks, dockerd, its containerd, files

What these machines need (see /work/shared/notes/docker-kind.md):
- root lacks CAP_SYS_RESOURCE, and dockerd 20.10 asks runc for every capability for a
  privileged container (kind's nodes are privileged). The default runtime is a wrapper
  that takes the capabilities this process cannot hold out of the OCI spec first.
- No NAT or forwarding is needed (the nodes talk over their bridge, the host reaches
  them on it, published ports go through docker-proxy), so dockerd changes no iptables
  rule and no host sysctl (`--iptables=false --ip-forward=false`), and makes no default
  bridge (`--bridge=none`); the networks kind creates get their subnets from a pool of
  our own and are removed before dockerd stops.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from nodepulse_dev.containerd import _kill_pid, _unmount_under
from nodepulse_dev.processes import stop_process

# Debian's docker.io: the engine and a CLI of the same release. (Another `docker` on
# PATH, e.g. a newer CLI without buildx, could not build with BuildKit.)
DOCKERD = Path("/usr/sbin/dockerd")
DOCKER_CLI = Path("/usr/bin/docker")
# Subnets for the networks of this engine (kind's "kind" network): clear of kind's pod
# and service ranges (10.244/16, 10.96/12) and of this host's own. Each engine takes the
# first of these no route of the host touches, so that two engines on the machine (two
# test runs) do not make bridges for the same subnet.
ADDRESS_POOLS = ["172.29.0.0/16", "172.30.0.0/16", "172.31.0.0/16", "172.28.0.0/16",
                 "172.27.0.0/16", "172.26.0.0/16"]

# The runc wrapper. Capability numbers are Linux's (include/uapi/linux/capability.h).
RUNC_WRAPPER = """\
#!{python} -I
# runc, minus the capabilities this process's bounding set lacks: asking for one of
# them fails every privileged container ("unable to apply caps").
import json, os, sys

RUNC = {runc!r}
CAPS = ["CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID",
        "SETUID", "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST",
        "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO",
        "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
        "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE",
        "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM",
        "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE"]
COMMANDS = {{"checkpoint", "create", "delete", "events", "exec", "features", "kill", "list",
            "pause", "ps", "restore", "resume", "run", "spec", "start", "state", "update"}}


def bounding():
    for line in open("/proc/self/status"):
        if line.startswith("CapBnd:"):
            return int(line.split()[1], 16)
    return -1


def strip(process, lacking):
    caps = process.get("capabilities") or {{}}
    for kind, names in caps.items():
        if names:
            caps[kind] = [n for n in names if n not in lacking]


def option(args, long, short):
    for i, a in enumerate(args):
        if a in (long, short) and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(long + "="):
            return a.split("=", 1)[1]
    return None


def main(args):
    have = bounding()
    lacking = {{"CAP_" + n for i, n in enumerate(CAPS) if not have >> i & 1}}
    # the first of runc's commands (global options before it may take values)
    command = next((a for a in args if a in COMMANDS), None)
    rest = args[args.index(command) + 1:] if command else []
    path = None
    if command in ("create", "run"):
        path = os.path.join(option(rest, "--bundle", "-b") or ".", "config.json")
    elif command == "exec":
        path = option(rest, "--process", "-p")
    if lacking and path and os.path.exists(path):
        with open(path) as f:
            spec = json.load(f)
        # config.json holds the process; exec's --process file is one
        strip(spec if command == "exec" else spec.get("process", {{}}), lacking)
        with open(path, "w") as f:
            json.dump(spec, f)
    os.execv(RUNC, [RUNC] + args)


main(sys.argv[1:])
"""


@dataclass
class Dockerd:
    """A running private dockerd. Stop it with stop(); it is idempotent."""

    base: Path
    proc: subprocess.Popen[bytes] | None
    keep_files: bool = False

    @property
    def socket(self) -> Path:
        return self.base / "docker.sock"

    @property
    def host(self) -> str:
        return f"unix://{self.socket}"

    @property
    def log_path(self) -> Path:
        return self.base / "dockerd.log"

    @property
    def bin_dir(self) -> Path:
        """Put first on PATH: `docker` here is Debian's CLI (kind runs `docker`)."""
        return self.base / "bin"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """This process's environment plus `extra`, with `docker` talking to this engine."""
        env = {**os.environ, **(extra or {})}
        env["DOCKER_HOST"] = self.host
        env["DOCKER_CONFIG"] = str(self.base / "client")  # no user's config or credentials
        env["PATH"] = f"{self.bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
        return env

    def docker(self, *args: str, timeout: float = 600, check: bool = True,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(DOCKER_CLI), *args], capture_output=True, text=True,
                              timeout=timeout, env=self.env(env), stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} exited {proc.returncode}:\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def child_pids(self) -> list[int]:
        """Processes this engine started that may outlive it: its containerd and the
        shims (they name our exec root), docker-proxy (it names a container IP of our
        pool but not our folder, so it is found as a child of dockerd)."""
        needle = str(self.base).encode()
        dockerd = self.proc.pid if self.proc else -1
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) in (os.getpid(), dockerd):
                continue
            try:
                cmdline = (d / "cmdline").read_bytes()
                ppid = int((d / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if needle in cmdline or ppid == dockerd:
                pids.append(int(d.name))
        return pids

    def bridges(self) -> list[str]:
        """Host links of this engine's networks (br-<network id>)."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        ids = self.docker("network", "ls", "--no-trunc", "--filter", "driver=bridge",
                          "--format", "{{.ID}}", check=False).stdout.split()
        return [f"br-{i[:12]}" for i in ids]

    def stop(self, timeout: float = 30.0) -> None:
        """Teardown that leaves nothing behind: containers (force-removed with their
        volumes), then the networks (their bridges go with them), dockerd by PID, stray
        children by PID, leftover mounts and links, then the folder."""
        links: list[str] = []
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(Exception):
                ids = self.docker("ps", "-aq", check=False).stdout.split()
                if ids:
                    self.docker("rm", "-f", "-v", *ids, check=False)
                links = self.bridges()
                networks = self.docker("network", "ls", "-q", "--filter", "type=custom",
                                       check=False).stdout.split()
                if networks:
                    self.docker("network", "rm", *networks, check=False)
            children = self.child_pids()
            stop_process(self.proc, timeout)
            for pid in children + self.child_pids():
                _kill_pid(pid, timeout)
        self.proc = None
        for link in links:
            subprocess.run(["ip", "link", "delete", link], capture_output=True, timeout=30)
        _unmount_under(self.base)
        if not self.keep_files:
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> Dockerd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def host_links() -> set[str]:
    """The names of the host's network links that a Docker engine makes: its networks'
    bridges (br-<network id>) and its containers' veths (veth and 7 hex digits; a CNI
    plugin's, which other tests on the machine make meanwhile, have 8)."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                         check=True).stdout
    return engine_links(line.split(":")[1].strip().split("@")[0] for line in out.splitlines())


def engine_links(names: Iterable[str]) -> set[str]:
    """Of these link names, those a Docker engine makes (see host_links)."""
    return {n for n in names if re.fullmatch(r"br-[0-9a-f]{12}|veth[0-9a-f]{7}", n)}


def host_rules() -> list[str]:
    """The host's iptables and ip6tables rules (no counters, no comment lines)."""
    rules = []
    for tool in ("iptables-save", "ip6tables-save"):
        out = subprocess.run([tool], capture_output=True, text=True, check=True).stdout
        rules += [line for line in out.splitlines() if not line.startswith("#")]
    return rules


def free_address_pool(routes: str | None = None) -> str:
    """The first of ADDRESS_POOLS that overlaps no route of the host (`ip -4 route`)."""
    if routes is None:
        routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"],
                                capture_output=True, text=True, check=True, timeout=30).stdout
    used = [ipaddress.ip_network(m, strict=False) for m in
            re.findall(r"^(?:\S+ )?(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", routes, re.M)]
    for pool in ADDRESS_POOLS:
        net = ipaddress.ip_network(pool)
        if not any(net.overlaps(u) for u in used):
            return pool
    raise RuntimeError(f"every address pool for a Docker engine is in use on this host "
                       f"({', '.join(ADDRESS_POOLS)}): another engine may still run")


def start_dockerd(*, base_dir: Path | None = None, ready_timeout: float = 60.0) -> Dockerd:
    """Start a private dockerd and wait until its API answers. Raises RuntimeError
    naming the log file if it exits or never answers."""
    for path, package in ((DOCKERD, "docker.io"), (DOCKER_CLI, "docker.io")):
        if not path.exists():
            raise RuntimeError(f"{path} not found: install the apt package {package}")
    runc = shutil.which("runc")
    if runc is None:
        raise RuntimeError("runc not found: install the apt package runc")
    # short path: unix socket paths are limited to 107 bytes
    base = Path(base_dir) if base_dir else Path(tempfile.mkdtemp(prefix="np-dkr-", dir="/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    wrapper = base / "runc-np"
    wrapper.write_text(RUNC_WRAPPER.format(python=sys.executable, runc=runc))
    wrapper.chmod(0o755)
    (base / "bin").mkdir(exist_ok=True)
    with contextlib.suppress(FileExistsError):
        (base / "bin" / "docker").symlink_to(DOCKER_CLI)
    (base / "client").mkdir(exist_ok=True)
    config = base / "daemon.json"  # not /etc/docker/daemon.json
    config.write_text(json.dumps({}))
    args = [str(DOCKERD), "--config-file", str(config),
            "--data-root", str(base / "root"), "--exec-root", str(base / "exec"),
            "--host", f"unix://{base / 'docker.sock'}", "--pidfile", str(base / "docker.pid"),
            "--iptables=false", "--ip6tables=false", "--ip-forward=false", "--bridge=none",
            "--default-address-pool", f"base={free_address_pool()},size=24",
            "--add-runtime", f"np-runc={wrapper}", "--default-runtime", "np-runc",
            "--storage-driver", "overlay2"]
    with open(base / "dockerd.log", "ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    engine = Dockerd(base=base, proc=proc)
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"dockerd exited with {proc.returncode}; see {engine.log_path}")
            if engine.socket.exists() and engine.docker("version", check=False,
                                                        timeout=10).returncode == 0:
                return engine
            if time.monotonic() > deadline:
                raise RuntimeError(f"dockerd did not answer within {ready_timeout:.0f} s; "
                                   f"see {engine.log_path}")
            time.sleep(0.2)
    except BaseException:
        engine.keep_files = True  # keep the log for the failure message
        engine.stop()
        raise


if __name__ == "__main__":
    # python -m e2e.kind.docker: start one, print how to reach it, stop on Enter
    eng = start_dockerd()
    print(f"export DOCKER_HOST={eng.host}  # pid {eng.proc.pid if eng.proc else '?'}")
    try:
        sys.stdin.readline()
    finally:
        eng.stop()
