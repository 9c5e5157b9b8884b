"""A shaped network link on one Linux machine, to run two parties across a real kernel TCP
path: two network namespaces joined by a veth pair, each end shaped by ``tbf`` (a rate and a
queue), optionally behind ``netem`` (a one-way delay), with a chosen TCP congestion control.

`NetnsLink` needs root (``CAP_NET_ADMIN``) and iproute2 (``ip``, ``tc``); where they are
missing, entering it raises `LinkSetupError` (a caller may then fall back, e.g. to
`tandem.transports.http.HttpConfig.shape_bandwidth` on loopback). Its two ends are called
``"A"`` and ``"B"``: run a program at an end with ``[*link.prefix("A"), ...]`` and reach it
at ``link.ip["A"]``. Leaving the context deletes both namespaces, whatever happened; names
carry the creating process's id, so `NetnsLink.remove_stale` can sweep what a killed process
left. ``bench.wan`` runs its two parties across one. Pure standard library (subprocess).
"""

from __future__ import annotations

import os
import re
import subprocess
from typing import Any

from tandem.errors import LinkSetupError

__all__ = ["LinkSetupError", "NetnsLink", "default_burst"]

A, B = "A", "B"  # the two ends; B's namespace is suffixed "l", A's "f"


def default_burst(rate_Bps: float) -> int:
    """tbf's bucket: at least 64 KiB (one GSO segment train), else ~2 ms at ``rate_Bps``."""
    return int(max(64 * 1024, rate_Bps * 0.002))


class NetnsLink:
    """Two network namespaces joined by a veth pair, both ends shaped by ``tbf``.

    ``rate_mbit`` each way; ``latency_ms``: the longest a packet waits in tbf's queue (its
    size); ``burst``: tbf's bucket in bytes (`default_burst`); ``tcp_cc``: the congestion
    control of every connection over the veth (None: the kernel's default). Use as a context
    manager; `__exit__` deletes both namespaces (which removes the veth pair) whatever
    happened. Names carry ``tag`` (the pid by default), so concurrent users do not collide;
    `remove_stale` sweeps only pid-tagged names."""

    def __init__(
        self,
        rate_mbit: float,
        *,
        latency_ms: float = 5.0,
        burst: int | None = None,
        tcp_cc: str | None = None,
        tag: str | None = None,
    ) -> None:
        tag = tag or str(os.getpid())
        self.rate_mbit = rate_mbit
        self.tcp_cc = tcp_cc  # None: the namespaces keep the kernel's default
        self.ns = {B: f"tdmwan{tag}l", A: f"tdmwan{tag}f"}
        self.dev = {B: f"tw{tag}l"[:15], A: f"tw{tag}f"[:15]}
        self.ip = {B: "10.213.0.1", A: "10.213.0.2"}
        rate_Bps = rate_mbit * 1e6 / 8
        self.burst = burst if burst is not None else default_burst(rate_Bps)
        # latency: the longest a packet may wait in the shaper's queue (its buffer size)
        self.tbf = [
            "rate",
            f"{rate_mbit}mbit",
            "burst",
            str(self.burst),
            "latency",
            f"{latency_ms:g}ms",
        ]
        self._made: list[str] = []
        self.netem: str | None = None  # the netem qdisc in front of tbf (`add_delay`)

    def _ip(self, *args: str) -> None:
        try:
            subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)
        except FileNotFoundError:
            raise LinkSetupError("the `ip` command (iproute2) is not installed") from None
        except subprocess.CalledProcessError as exc:
            raise LinkSetupError(f"`ip {' '.join(args)}` failed: {exc.stderr.strip()}") from None

    def __enter__(self) -> NetnsLink:
        try:
            for party in (B, A):
                self._ip("netns", "add", self.ns[party])
                self._made.append(self.ns[party])
            self._ip("link", "add", self.dev[B], "type", "veth", "peer", "name", self.dev[A])
            for party in (B, A):
                ns, dev = self.ns[party], self.dev[party]
                self._ip("link", "set", dev, "netns", ns)
                self._ip("-n", ns, "addr", "add", f"{self.ip[party]}/30", "dev", dev)
                self._ip("-n", ns, "link", "set", dev, "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
                self._ip(
                    "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", *self.tbf
                )
                if self.tcp_cc is not None:
                    self._set_congestion_control(party)
        except BaseException:
            self.close()
            raise
        return self

    def _set_congestion_control(self, party: str) -> None:
        """Every connection over the veth uses ``tcp_cc``: a route attribute (``congctl``),
        because a namespace's sysctl offers only the host's ``tcp_allowed_congestion_control``."""
        ns, dev = self.ns[party], self.dev[party]
        try:
            self._ip(
                *("-n", ns, "route", "replace", "10.213.0.0/30", "dev", dev),
                *("proto", "kernel", "scope", "link", "src", self.ip[party]),
                *("congctl", str(self.tcp_cc)),
            )
        except LinkSetupError as exc:
            raise LinkSetupError(
                f"{exc} (is `{self.tcp_cc}` in /proc/sys/net/ipv4/"
                "tcp_available_congestion_control? --tcp-cc default keeps the kernel's)"
            ) from None

    def congestion_control(self) -> str:
        """The congestion control of connections over the veth: ``tcp_cc``, or the
        namespaces' default when none was set."""
        if self.tcp_cc is not None:
            return self.tcp_cc
        got = subprocess.run(
            [*self.prefix(B), "cat", "/proc/sys/net/ipv4/tcp_congestion_control"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return got.stdout.strip() or "unknown"

    def add_delay(self, one_way_ms: float) -> str | None:
        """Put ``netem delay`` in front of each end's ``tbf`` (``netem`` as the root qdisc,
        ``tbf`` its child), so each direction gets ``one_way_ms`` of propagation delay on top
        of its rate. Returns None when done, or why not (a kernel without ``sch_netem``): then
        the ends keep their plain ``tbf`` and the caller puts a relay in the path instead."""
        # netem's queue must hold the bytes in flight: a rate's worth of one_way_ms, in packets
        limit = max(1000, int(self.rate_mbit * 1e6 / 8 * one_way_ms / 1e3 / 1000) * 4)
        done: list[str] = []
        try:
            for party in (B, A):
                ns, dev = self.ns[party], self.dev[party]
                tc = ["netns", "exec", ns, "tc", "qdisc"]
                self._ip(*tc, "del", "dev", dev, "root")
                done.append(party)
                self._ip(
                    *tc,
                    "add",
                    "dev",
                    dev,
                    "root",
                    "handle",
                    "1:",
                    "netem",
                    "delay",
                    f"{one_way_ms:g}ms",
                    "limit",
                    str(limit),
                )
                self._ip(*tc, "add", "dev", dev, "parent", "1:1", "handle", "10:", "tbf", *self.tbf)
        except LinkSetupError as exc:
            for party in done:  # back to the plain shaper
                ns, dev = self.ns[party], self.dev[party]
                tc = ["netns", "exec", ns, "tc", "qdisc"]
                subprocess.run(
                    ["ip", *tc, "del", "dev", dev, "root"], capture_output=True, timeout=20
                )
                self._ip(*tc, "add", "dev", dev, "root", "tbf", *self.tbf)
            return str(exc)
        self.netem = f"netem delay {one_way_ms:g}ms limit {limit}"
        return None

    def prefix(self, party: str) -> list[str]:
        """Command prefix running a program inside ``party``'s namespace."""
        return ["ip", "netns", "exec", self.ns[party]]

    def close(self) -> None:
        """Delete what `__enter__` made (idempotent). Deleting a namespace deletes its veth end
        and so the pair; a pair not yet moved into a namespace is deleted explicitly."""
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        if self._made:
            subprocess.run(["ip", "link", "del", self.dev[B]], capture_output=True, timeout=20)
        self._made.clear()

    @staticmethod
    def remove_stale() -> list[str]:
        """Delete namespaces left by an earlier run whose process is gone (killed with
        SIGKILL, so its finally blocks never ran); returns their names."""
        try:
            out = subprocess.run(
                ["ip", "netns", "list"], capture_output=True, text=True, timeout=20
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        stale = []
        for line in out.splitlines():
            m = re.match(r"(tdmwan(\d+)[lf])\b", line)
            if m and not os.path.exists(f"/proc/{m.group(2)}"):
                subprocess.run(["ip", "netns", "del", m.group(1)], capture_output=True, timeout=20)
                stale.append(m.group(1))
        return stale

    def __exit__(self, *exc: object) -> None:
        self.close()

    def counters(self) -> dict[str, dict[str, Any]]:
        """Per party: its veth end's qdisc counters (``tc -s qdisc``: packets sent, dropped)
        and its namespace's TCP counters (``/proc/net/snmp``, ``/proc/net/netstat``), totals
        since the namespaces were made (connections on loopback included)."""
        out: dict[str, dict[str, Any]] = {}
        for party in (B, A):
            run = [*self.prefix(party)]
            try:
                qdisc = subprocess.run(
                    [*run, "tc", "-s", "qdisc", "show", "dev", self.dev[party]],
                    capture_output=True,
                    text=True,
                    timeout=20,
                    check=True,
                ).stdout
                snmp = subprocess.run(
                    [*run, "cat", "/proc/net/snmp", "/proc/net/netstat"],
                    capture_output=True,
                    text=True,
                    timeout=20,
                    check=True,
                ).stdout
            except (OSError, subprocess.SubprocessError) as exc:
                out[party] = {"error": str(exc)}
                continue
            sent = [int(v) for v in re.findall(r"Sent \d+ bytes (\d+) pkt", qdisc)]
            dropped = [int(v) for v in re.findall(r"dropped (\d+)", qdisc)]
            lines = snmp.splitlines()
            tcp: dict[str, int] = {}
            for head, vals in zip(lines, lines[1:], strict=False):
                names, values = head.split(), vals.split()
                if names[:1] == values[:1] and names[0] in ("Tcp:", "TcpExt:"):
                    if not values[1].lstrip("-").isdigit():
                        continue
                    tcp.update(zip(names[1:], map(int, values[1:]), strict=True))
            keep = (
                "OutSegs",
                "RetransSegs",
                "TCPTimeouts",
                "TCPLossProbes",
                "TCPFastRetrans",
                "TCPSpuriousRTOs",
                "ActiveOpens",
                "PassiveOpens",
            )
            out[party] = {
                "qdisc_sent_pkts": max(sent, default=0),
                "qdisc_dropped_pkts": max(dropped, default=0),
                "tcp": {k: tcp[k] for k in keep if k in tcp},
            }
        return out

    def describe(self) -> dict[str, Any]:
        """The link as JSON-ready data: kind, rate, tbf arguments, congestion control,
        namespaces (and the netem qdisc, after `add_delay`)."""
        out = {
            "kind": "netns-veth-tbf",
            "rate_mbit": self.rate_mbit,
            "tc": "tbf " + " ".join(self.tbf),
            "tcp_congestion_control": self.congestion_control(),
            "namespaces": list(self.ns.values()),
        }
        if self.netem is not None:
            out["netem"] = self.netem
        return out
