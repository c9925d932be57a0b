"""Hosts made of Linux network namespaces, for the tests and benches that need more than one machine
(the `multihost` tests, `vigil bench elastic`).

`Network.create(["a", "b"])` makes, in the test's own (root) namespace, a bridge holding the first address
of a private 10.x.y.0/24 that no route here uses yet, and per host a network namespace with its own
loopback and an `eth0` (a veth whose other end is on the bridge) holding the next address. The hosts reach
each other and the root namespace over the bridge, and nothing else. A process started with `Host.argv`
runs in its host's network namespace and, through UTS and mount namespaces of its own, under its host's
name, with an /etc/hosts (`/etc/netns/<ns>/hosts`, bound over it) where the other hosts' names resolve to
their addresses and its own, as on Debian, to 127.0.1.1.

Where iptables is installed, the bridge's traffic is let through the FORWARD chain by a rule of its own
(`-i BRIDGE -o BRIDGE -j ACCEPT`, first in the chain): with bridge netfilter on, frames between the hosts
pass that chain, whose policy a Docker daemon sets to DROP as it starts; the hosts do not depend on it.

Everything is named `vmh<pid>...` after the process that made it: `Network.destroy()` (idempotent; also
run at exit, and on a second SIGTERM/SIGHUP: the first interrupts the run as Ctrl-C does, so that every
teardown runs in order) ends every process left in the namespaces and removes them, the veths, the bridge,
its FORWARD rule and the hosts files; `remove_leftovers()` removes what a run that died (SIGKILL) left
behind, that is everything named after a process that no longer exists.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import random
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREFIX = "vmh"  # vigil multihost: every namespace, link and hosts folder is PREFIX<pid>...
NETNS_ETC = Path("/etc/netns")
_NAME = re.compile(rf"^{PREFIX}(\d+)")


def ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def forward_rule(bridge: str) -> list[str]:
    """The FORWARD rule letting `bridge`'s traffic through, as `iptables -S` lists it (after `-A FORWARD`)."""
    return ["-i", bridge, "-o", bridge, "-j", "ACCEPT"]


def _iptables(*args: str) -> subprocess.CompletedProcess[str] | None:
    """`iptables ARGS` (waiting for the xtables lock); None where iptables is not installed."""
    if not shutil.which("iptables"):
        return None
    return subprocess.run(["iptables", "-w", "10", *args], capture_output=True, text=True, timeout=30)


def _forward_bridges() -> list[str]:
    """The bridges that have a `forward_rule` in the FORWARD chain."""
    listed = _iptables("-S", "FORWARD")
    if listed is None or listed.returncode != 0:
        return []
    found = []
    for line in listed.stdout.splitlines():
        words = line.split()
        if words[:2] == ["-A", "FORWARD"] and len(words) == 8 and words[2:] == forward_rule(words[3]):
            found.append(words[3])
    return found


def _alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (one no parent reaped is gone all the same). Not
    `kill(pid, 0)`: that also answers for a thread of another process whose id is `pid`."""
    try:
        status = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
        )
    except OSError:
        return False
    return status.get("Tgid", "").strip() == str(pid) and not status.get("State", "").strip().startswith("Z")


def _kill_all(netns: str) -> None:
    """SIGKILL every process in `netns` until none is left (a dying worker may still start one)."""
    for _ in range(50):
        pids = [int(p) for p in ip("netns", "pids", netns, check=False).split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in pids:  # reap our own children; others are reaped by their parents
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)


def _remove(netns: list[str], links: list[str], folders: list[Path]) -> None:
    for name in netns:
        _kill_all(name)
        ip("netns", "del", name, check=False)  # the veth inside goes, and with it its peer
    for link in links:
        ip("link", "del", link, check=False)
    ruled = _forward_bridges()
    for bridge in [link for link in links if link in ruled]:
        _iptables("-D", "FORWARD", *forward_rule(bridge))
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def remove_leftovers() -> list[str]:
    """Remove namespaces, links and hosts folders named after a process that is gone (a run killed
    before it could clean up); what was removed."""

    def stale(name: str) -> bool:
        m = _NAME.match(name)
        return bool(m) and not _alive(int(m.group(1)))

    netns = [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in ip("-o", "link", "show").splitlines()]
    links += [b for b in _forward_bridges() if b not in links]  # a rule whose bridge is gone already
    folders = [p for p in NETNS_ETC.glob(f"{PREFIX}*")] if NETNS_ETC.exists() else []
    gone = (
        [n for n in netns if stale(n)],
        [n for n in links if stale(n)],
        [p for p in folders if stale(p.name)],
    )
    _remove(*gone)
    return [*gone[0], *gone[1], *(str(p) for p in gone[2])]


def free_subnet(rng: random.Random | None = None) -> ipaddress.IPv4Network:
    """A random 10.x.y.0/24 that no address or route of this namespace overlaps (nor the resolver's)."""
    rng = rng or random.Random()
    used = []
    for line in (
        ip("-4", "-o", "addr", "show").splitlines() + ip("-4", "route", "show", "table", "all").splitlines()
    ):
        for token in line.split():
            with contextlib.suppress(ValueError):
                if token[0].isdigit():
                    used.append(ipaddress.ip_network(token, strict=False))
    with contextlib.suppress(OSError):
        for line in Path("/etc/resolv.conf").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                with contextlib.suppress(ValueError):
                    used.append(ipaddress.ip_network(parts[1]))
    for _ in range(1000):
        net = ipaddress.ip_network(f"10.{rng.randrange(16, 250)}.{rng.randrange(0, 256)}.0/24")
        if not any(net.overlaps(u) for u in used if u.version == 4 and u.prefixlen > 0):
            return net
    raise RuntimeError("no free 10.x.y.0/24 found")


@dataclass
class Host:
    """One namespace host: its name (the UTS host name), namespace, address and root-side link."""

    name: str
    hostname: str
    netns: str
    address: str
    link: str  # the veth end on the bridge, in the root namespace: down = the host is cut off

    @property
    def hosts_file(self) -> Path:
        return NETNS_ETC / self.netns / "hosts"

    def argv(self, command: Sequence[str]) -> list[str]:
        """`command` run in this host: its network namespace, a UTS namespace named after it, and a mount
        namespace where /etc/hosts is the host's. (Not `ip netns exec`, which also mounts a /sys of the
        namespace's own, without the cgroup hierarchy below it that slurmd needs.)"""
        return [
            "nsenter", f"--net=/run/netns/{self.netns}",
            "unshare", "--uts", "--mount",
            "sh", "-c", 'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"',
            self.hostname, str(self.hosts_file), *command,
        ]  # fmt: skip

    def popen(self, command: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start `command` in this host; each `exec` replaces the last, so the pid is the command's."""
        return subprocess.Popen(self.argv(command), **kwargs)

    def run(self, command: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(command), capture_output=True, text=True, timeout=timeout)

    def pids(self) -> list[int]:
        return [int(p) for p in ip("netns", "pids", self.netns, check=False).split()]

    def cut(self) -> None:
        """Take the host off the network: its link to the bridge goes down (the machine's cable pulled)."""
        ip("link", "set", self.link, "down")

    def reconnect(self) -> None:
        ip("link", "set", self.link, "up")

    def kill_all(self) -> None:
        """SIGKILL every process running in this host."""
        _kill_all(self.netns)


@dataclass
class Network:
    """A bridge in the root namespace (`gateway` is its address) and the hosts on it."""

    tag: str
    subnet: ipaddress.IPv4Network
    bridge: str
    gateway: str
    hosts: list[Host] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _destroyed: bool = field(default=False, repr=False)
    _interrupted: bool = field(default=False, repr=False)
    _handlers: dict[int, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def create(cls, names: Sequence[str]) -> Network:
        """The bridge and one host per name (host name `host<name>`), cleaned up at exit and on SIGTERM
        or SIGHUP whatever happens to the caller; `destroy()` cleans up earlier."""
        tag = f"{PREFIX}{os.getpid()}"
        existing = [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]
        if any(n.startswith(f"{tag}-") for n in existing):
            raise RuntimeError(f"this process already has namespaces {tag}-*: one Network at a time")
        subnet = free_subnet()
        addrs = list(subnet.hosts())
        net = cls(tag=tag, subnet=subnet, bridge=f"{tag}br", gateway=str(addrs[0]))
        net._arm()
        try:
            ip("link", "add", net.bridge, "type", "bridge")
            ip("addr", "add", f"{net.gateway}/{subnet.prefixlen}", "dev", net.bridge)
            ip("link", "set", net.bridge, "up")
            ruled = _iptables("-I", "FORWARD", "1", *forward_rule(net.bridge))
            if ruled is not None and ruled.returncode != 0:
                raise RuntimeError(f"iptables -I FORWARD for {net.bridge}: {ruled.stderr.strip()}")
            for i, name in enumerate(names):
                net.hosts.append(net._add_host(name, str(addrs[i + 1])))
            net._write_hosts_files()
        except BaseException:
            net.destroy()
            raise
        return net

    def _add_host(self, name: str, address: str) -> Host:
        host = Host(
            name=name, hostname=f"host{name}", netns=f"{self.tag}-{name}", address=address,
            link=f"{self.tag}{name}",
        )  # fmt: skip
        inner = f"{self.tag}{name}i"
        ip("netns", "add", host.netns)
        ip("link", "add", host.link, "type", "veth", "peer", "name", inner, "netns", host.netns)
        ip("link", "set", host.link, "master", self.bridge)
        ip("link", "set", host.link, "up")
        ip("-n", host.netns, "link", "set", "lo", "up")
        ip("-n", host.netns, "link", "set", inner, "name", "eth0")
        ip("-n", host.netns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        ip("-n", host.netns, "link", "set", "eth0", "up")
        return host

    def _write_hosts_files(self) -> None:
        """Each host's /etc/hosts as Debian writes it, its own name on 127.0.1.1 (what trips up software
        that takes the address its host name resolves to for one the others reach), and the other hosts'
        names and the root namespace's on their addresses."""
        root = os.uname().nodename
        for h in self.hosts:
            lines = ["127.0.0.1 localhost", f"127.0.1.1 {h.hostname}", f"{self.gateway} {root}"]
            lines += [f"{o.address} {o.hostname}" for o in self.hosts if o is not h]
            h.hosts_file.parent.mkdir(parents=True, exist_ok=True)
            h.hosts_file.write_text("\n".join(lines) + "\n")

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    # --- cleanup, whatever happens ------------------------------------------------------------------

    def _arm(self) -> None:
        atexit.register(self.destroy)
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGHUP):
            self._handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        """Where the signal would have ended the process: the first one raises KeyboardInterrupt, as
        Ctrl-C does, so that pytest tears every fixture down in order (the control plane and the Slurm
        daemons while the hosts still reach them, the hosts last) and exits; a second one (teardown
        stuck, or no patience) removes the hosts at once and ends the process. Where another handler
        was in place, the hosts are removed and that handler runs."""
        previous = self._handlers.get(signum, signal.SIG_DFL)
        if callable(previous):
            self.destroy()
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            if not self._interrupted:
                self._interrupted = True
                raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")
            self.destroy()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def destroy(self) -> None:
        """End every process in the hosts and remove the namespaces, links and hosts files. Idempotent; a
        signal arriving meanwhile does not start it again (what it leaves, `remove_leftovers` removes)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._destroyed:
                return
            self._destroyed = True
            _remove(
                [h.netns for h in self.hosts],
                [h.link for h in self.hosts] + [self.bridge],
                [NETNS_ETC / h.netns for h in self.hosts],
            )
            # a host whose creation failed half-way: whatever carries this run's tag
            leftovers = [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]
            _remove([n for n in leftovers if n.startswith(f"{self.tag}-")], [], [])
        finally:
            self._lock.release()
            atexit.unregister(self.destroy)
            if threading.current_thread() is threading.main_thread():
                for signum, previous in self._handlers.items():
                    if signal.getsignal(signum) == self._on_signal:
                        signal.signal(signum, previous)
                self._handlers.clear()
