"""Smoke tests of `bench.wan` on a tiny configuration, and of the shaped link it runs across
(`tandem.transports.netns.NetnsLink`).

The loopback test runs everywhere (two real processes over HTTP, in-transport shaping): one JSON
line on stdout, every key present, every number finite and consistent with its definition (the
speed targets are the benchmark's business, not a test's). The namespace tests need root and
iproute2 and are skipped otherwise: the link is removed when the benchmark is terminated, and
namespaces left by a killed run are swept up.
"""

import fcntl
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from run_helpers import run_bench
from tandem.transports.netns import LinkSetupError, NetnsLink

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--batch-size",
    "64",
    "--batches",
    "2",
    "--repeats",
    "1",
    "--d-in",
    "8",
    "--hidden",
    "16",
    "--cut",
    "8",
    "--sweep",
    "2",
    "--tune-epochs",
    "2",
    "--rate-mbit",
    "10",
    "--probe-mib",  # the goodput probe between namespaces: 1 MiB each way takes ~1 s at 10 Mbit/s
    "1",
]
KEYS = (
    "sequential_s",
    "pipelined_s",
    "bound_s",
    "speedup",
    "efficiency",
    "n_groups",
    "link",
    "bound_terms",
    "sweep",
    "workload",
    "runs",
    "load",
)


def _bench(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "bench.wan", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        **kw,
    )


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _can_make_namespaces() -> bool:
    if os.name != "posix" or os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    try:  # the whole link (namespaces, veth, tbf), as the benchmark makes it
        with NetnsLink(10.0, tag=f"p{os.getpid()}"):
            return True
    except LinkSetupError:
        return False


_netns_allowed = pytest.mark.skipif(
    not _can_make_namespaces(), reason="needs root, iproute2 and permission to make namespaces"
)


def needs_netns(test):
    """Skipped without root and iproute2; run holding `netns_lock`."""
    return pytest.mark.usefixtures("netns_lock")(_netns_allowed(test))


@pytest.fixture
def netns_lock():
    """One namespace test at a time on this machine, whichever xdist worker or pytest session
    runs it: a benchmark started with ``--link netns`` sweeps up the namespaces of dead pids,
    so it would delete the one `test_stale_namespaces_swept` has just made for its own sweep."""
    with open(Path(tempfile.gettempdir()) / "tandem-netns-tests.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


@pytest.mark.slow
def test_wan_bench_loopback_tiny():
    proc = _bench("--json", "--link", "loopback", *TINY)
    out, err = proc.communicate(timeout=110)
    assert proc.returncode == 0, err
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out  # exactly one JSON line on stdout; progress went to stderr
    assert "[bench.wan leader]" in err
    r = json.loads(lines[0])
    for key in KEYS:
        assert key in r, key
    for key in ("sequential_s", "pipelined_s", "bound_s", "speedup", "efficiency"):
        assert math.isfinite(r[key]) and r[key] > 0, key
    assert r["link"]["kind"] == "loopback-shaped"
    assert r["link"]["fallback_reason"] == "--link loopback"
    assert r["link"]["goodput_MBps"] == {"B->A": 1.25, "A->B": 1.25}
    terms = {k: v for k, v in r["bound_terms"].items() if k != "definition"}
    assert set(terms) == {"compute[A]", "compute[B]", "link[A->B]", "link[B->A]"}
    assert r["bound_s"] == pytest.approx(max(terms.values()))
    # each direction carries batches x batch_size x cut float32 tensors at 1.25 MB/s
    assert terms["link[A->B]"] == pytest.approx(2 * 64 * 8 * 4 / 1.25e6)
    assert r["speedup"] == pytest.approx(r["sequential_s"] / r["pipelined_s"])
    assert r["efficiency"] == pytest.approx(r["bound_s"] / r["pipelined_s"])
    assert set(r["sweep"]) == {"2"} and 1 <= r["n_groups"] <= 64
    assert len(r["runs"]["sequential_s"]) == len(r["runs"]["pipelined_s"]) == 1
    assert len(r["load"]["loadavg_start"]) == 3


def _check_rtt_run(r: dict, rtt_ms: float) -> None:
    """The keys of a run with ``--rtt-ms``: the delay is in the path (the measured round trip
    is at least the requested one), and the bound adds one round trip per batch."""
    assert r["rtt_requested_ms"] == rtt_ms
    assert r["rtt_ms"] >= rtt_ms
    assert r["rtt_via"] in ("netem", "relay")
    if r["rtt_via"] == "relay":
        assert "netem unavailable" in r.get("rtt_relay_reason", "netem unavailable")
    terms = {k: v for k, v in r["bound_terms"].items() if k != "definition"}
    batches = r["workload"]["batches"]
    assert r["bound_round_trips_s"] == pytest.approx(batches * r["rtt_ms"] / 1e3)
    assert r["bound_s"] == pytest.approx(max(terms.values()) + r["bound_round_trips_s"])
    assert r["efficiency"] == pytest.approx(r["bound_s"] / r["pipelined_s"])
    # every timed batch waits at least one round trip, sequential or pipelined
    assert min(r["runs"]["sequential_s"] + r["runs"]["pipelined_s"]) >= r["bound_round_trips_s"]


def _run_json(*args: str) -> tuple[dict, str]:
    proc = _bench("--json", *args)
    out, err = proc.communicate(timeout=110)
    assert proc.returncode == 0, err
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    return json.loads(lines[0]), err


@pytest.mark.slow
def test_wan_bench_rtt_relay_loopback_tiny():
    """``--rtt-ms`` without namespaces: a delaying relay carries both directions."""
    r, _ = _run_json("--link", "loopback", "--rtt-ms", "20", *TINY)
    assert r["link"]["kind"] == "loopback-shaped"
    assert r["rtt_via"] == "relay"
    _check_rtt_run(r, 20.0)


@needs_netns
@pytest.mark.slow
def test_wan_bench_rtt_netns_tiny():
    """``--rtt-ms`` between namespaces: netem where the kernel has it, else the relay in the
    follower's namespace; no namespace is left behind."""
    r, err = _run_json("--link", "netns", "--rtt-ms", "20", *TINY)
    assert r["link"]["kind"] == "netns-veth-tbf"
    assert ("netem" in r["link"]) == (r["rtt_via"] == "netem")
    _check_rtt_run(r, 20.0)
    assert not {ns for ns in r["link"]["namespaces"]} & _namespaces()


@needs_netns
def test_netns_link_removed_on_error():
    link = NetnsLink(10.0, tag=f"t{os.getpid()}")
    with pytest.raises(RuntimeError, match="boom"):
        with link:
            assert set(link.ns.values()) <= _namespaces()
            raise RuntimeError("boom")
    assert not set(link.ns.values()) & _namespaces()


@needs_netns
def test_netns_link_congestion_control_and_counters():
    """``tcp_cc`` is the congestion control of a connection across the veth pair, in both
    directions' namespaces; `counters` reads each end's qdisc and its namespace's TCP."""
    with NetnsLink(10.0, tcp_cc="reno", tag=f"c{os.getpid()}") as link:
        assert link.congestion_control() == "reno"
        assert link.describe()["tcp_congestion_control"] == "reno"
        server = subprocess.Popen(
            [*link.prefix("A"), sys.executable, "-c", _CC_SERVER, link.ip["A"]],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout.readline().strip() == "listening"
            client = subprocess.run(
                [*link.prefix("B"), sys.executable, "-c", _CC_CLIENT, link.ip["A"]],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            out, _ = server.communicate(timeout=30)
        finally:
            if server.poll() is None:
                server.kill()
                server.communicate()
        assert client.stdout.strip() == "reno"  # the connecting side
        assert out.strip() == "reno"  # the accepting side
        counters = link.counters()
        for party in ("A", "B"):
            assert counters[party]["qdisc_sent_pkts"] > 0
            assert counters[party]["tcp"]["ActiveOpens" if party == "B" else "PassiveOpens"] >= 1


@needs_netns
def test_netns_link_unknown_congestion_control():
    link = NetnsLink(10.0, tcp_cc="no-such-cc", tag=f"u{os.getpid()}")
    with pytest.raises(LinkSetupError, match="tcp_available_congestion_control"):
        link.__enter__()
    assert not set(link.ns.values()) & _namespaces()


_CC_SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], 5201))
print("listening", flush=True)
c, _ = s.accept()
print(c.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\\0").decode())
"""
_CC_CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], 5201), timeout=10)
print(c.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\\0").decode())
"""


@needs_netns
def test_stale_namespaces_swept():
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"tdmwan{dead.pid}l"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in NetnsLink.remove_stale()
        assert name not in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@needs_netns
@pytest.mark.slow
def test_wan_bench_sigterm_removes_namespaces_and_children():
    proc = _bench("--json", "--link", "netns", *TINY)
    mine = {f"tdmwan{proc.pid}l", f"tdmwan{proc.pid}f"}
    try:
        deadline = time.monotonic() + 60
        children: set[int] = set()
        while time.monotonic() < deadline and len(children) < 2:  # leader and follower up
            time.sleep(0.2)
            assert proc.poll() is None, proc.stderr.read()
            children = _children(proc.pid)
        assert len(children) == 2 and mine <= _namespaces()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
        assert proc.returncode != 0
        assert not mine & _namespaces()
        assert not any(Path(f"/proc/{pid}").exists() for pid in children)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for ns in mine:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _children(pid: int) -> set[int]:
    kids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.add(int(stat.parent.name))
    return kids


def test_size_workload_search(tmp_path):
    """The width search on a model of compute time (no timing), through ``python -m bench.wan
    --size-only --compute-table``: converges on a linear machine; keeps the best measured
    width when noise keeps it from converging."""
    # one direction carries 64 x 8 float32 per batch: 0.35 s at this rate
    rate_mbit = 64 * 8 * 4 * 8 / 0.35 / 1e6

    def run(model):
        table = tmp_path / "compute.json"
        table.write_text(json.dumps({h: model(h) for h in range(16, 16385, 16)}))
        out, lines = run_bench(
            "wan",
            "--size-only",
            "--compute-table",
            str(table),
            *("--batch-size=64", "--d-in=8", "--cut=8", "--top-hidden=4"),
            f"--rate-mbit={rate_mbit!r}",
        )
        assert len(lines) == 1 and out["link_per_batch_s"] == pytest.approx(0.35)
        calls = [h for h, _ in out["measured"]]
        assert calls[0] == 1024 and all(t == model(h) for h, t in out["measured"])
        return out["hidden"], out["compute_per_batch_s"], calls

    got, c, calls = run(lambda h: 0.02 + 1e-4 * h)  # 0.35 s at h = 3300
    assert abs(0.35 / c - 1) <= 0.15 and c == pytest.approx(0.02 + 1e-4 * got)
    assert len(calls) <= 4
    noisy = {1024: 0.092, 3888: 0.463, 2928: 0.217}  # a loaded machine (measured once)
    got, c, calls = run(lambda h: noisy.get(h, 0.6))
    assert len(calls) <= 4 and got in calls
    assert c == min((noisy.get(h, 0.6) for h in calls), key=lambda t: abs(math.log(0.35 / t)))


def test_party_options_reach_both_processes():
    """The options a leader or follower process reads are forwarded to both (``--chunks``
    and ``--send-window`` were once left out, so the leader ran with their defaults):
    ``python -m bench.wan --print-commands`` shows both command lines."""
    given = {
        "chunks": "3",
        "send-window": "5",
        "rtt-ms": "20.0",
        "compress": "int8",
        "hidden": "64",
    }
    out, lines = run_bench("wan", "--print-commands", *(f"--{k}={v}" for k, v in given.items()))
    assert len(lines) == 1 and set(out) == {"leader", "follower"}
    for role, cmd in out.items():
        assert cmd[cmd.index("--role") + 1] == role
        assert cmd[cmd.index("-m") + 1] == "bench.wan"
        for key, value in given.items():
            assert f"--{key}={value}" in cmd, (role, key, cmd)
