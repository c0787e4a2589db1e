"""The split deployment across a real network stack, on one machine: network namespaces.

    with Topology() as net:                      # root: `ip netns` + veth pairs
        proc = subprocess.Popen(net.run_in("verifier", ["presto-sd", "serve", "verifier",
                                "--host", net.address("verifier"), "--port", "50051"]))
        net.set_rtt(0.002)                       # tc netem on the hub's ends, where the kernel has it
        net.cut("drafter"); net.restore("drafter")

The drafter and the verifier each get a namespace of their own, joined to the
orchestrator's (the hub: where the loop runs) by a veth pair, ``10.77.k.1`` on the hub's
end and ``10.77.k.2`` on the host's. Their addresses exist only inside those namespaces:
nothing outside them can reach the servers, and the loop reaches them only across the
veths, through the kernel's whole TCP/IP path. The feature deltas travel the way they do
between pods: verifier -> hub -> drafter.

Delay: ``tc netem`` on the hub's end of each pair (every packet the hub sends waits the
whole round trip, so each call pays it once). A kernel without qdiscs (this project's
CI machines: "Specified qdisc kind is unknown") gets ``netem = False``; then the caller
delays in user space inside the hub (``presto_sd.app.bench.link.DelayLink`` relaying to
the hosts' addresses). A cut is the link taken down (``ip link set ... down``): packets
are dropped, as with a pulled cable, until it is restored.

Everything made is removed on exit, on an exception, and at interpreter exit.
"""

from __future__ import annotations

import atexit
import os
import subprocess
from collections.abc import Sequence

HOSTS = ("drafter", "verifier")
PREFIX = "10.77"


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"psd-probe-{os.getpid()}"
    try:
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`ip netns add` failed: {e}"
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


class Topology:
    """A hub namespace and one per host, each host joined to the hub by a veth pair."""

    def __init__(self, hosts: Sequence[str] = HOSTS, tag: str | None = None) -> None:
        self.tag = tag or f"psd{os.getpid() % 100000}"
        self.hosts = tuple(hosts)
        self.netem = False  # whether the kernel delays (tc netem); else the caller relays
        self._made: list[str] = []
        self._down = False

    # -- names ------------------------------------------------------------------------
    def namespace(self, host: str) -> str:
        return f"{self.tag}-{host}"

    @property
    def hub(self) -> str:
        return f"{self.tag}-hub"

    def address(self, host: str) -> str:
        """The host's address: reachable from the hub only."""
        return f"{PREFIX}.{self.hosts.index(host) + 1}.2"

    def _hub_dev(self, host: str) -> str:
        return f"{self.tag[:9]}h{self.hosts.index(host)}"  # <= 15 characters, as Linux wants

    def _host_dev(self, host: str) -> str:
        return f"{self.tag[:9]}x{self.hosts.index(host)}"

    def run_in(self, host: str | None, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace (None: the hub's)."""
        return ["ip", "netns", "exec", self.hub if host is None else self.namespace(host), *argv]

    # -- life -------------------------------------------------------------------------
    def __enter__(self) -> Topology:
        atexit.register(self.down)
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _up(self) -> None:
        for ns in (self.hub, *map(self.namespace, self.hosts)):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        for i, host in enumerate(self.hosts, start=1):
            hub_dev, host_dev, ns = self._hub_dev(host), self._host_dev(host), self.namespace(host)
            _ip("-n", self.hub, "link", "add", hub_dev, "type", "veth", "peer", "name", host_dev, "netns", ns)
            _ip("-n", self.hub, "addr", "add", f"{PREFIX}.{i}.1/30", "dev", hub_dev)
            _ip("-n", ns, "addr", "add", f"{PREFIX}.{i}.2/30", "dev", host_dev)
            _ip("-n", self.hub, "link", "set", hub_dev, "up")
            _ip("-n", ns, "link", "set", host_dev, "up")
        self.netem = self._tc(self.hosts[0], "add", 0.0)
        if self.netem:
            for host in self.hosts[1:]:
                self._tc(host, "add", 0.0)

    def down(self) -> None:
        """Stop what runs in the namespaces and delete them (their veths go with them)."""
        if self._down:
            return
        self._down = True
        for ns in reversed(self._made):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()

    # -- the link ---------------------------------------------------------------------
    def set_rtt(self, rtt_s: float) -> None:
        """Every hub-to-host link delays its packets by ``rtt_s`` (netem only)."""
        if not self.netem:
            raise RuntimeError("this kernel has no netem: delay in user space (DelayLink)")
        for host in self.hosts:
            self._tc(host, "change", rtt_s)

    def cut(self, host: str) -> None:
        _ip("-n", self.hub, "link", "set", self._hub_dev(host), "down")

    def restore(self, host: str) -> None:
        _ip("-n", self.hub, "link", "set", self._hub_dev(host), "up")

    def _tc(self, host: str, verb: str, rtt_s: float) -> bool:
        cmd = ["ip", "netns", "exec", self.hub, "tc", "qdisc", verb, "dev", self._hub_dev(host), "root",
               "netem", "delay", f"{rtt_s * 1e3:.3f}ms"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 and verb != "add":
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
        return done.returncode == 0


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
