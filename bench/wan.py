"""WAN benchmark: split learning between two OS processes over `HttpTransport` on a shaped link.

``python -m bench.wan --json`` prints ONE JSON line (progress goes to stderr). Needs root for
the network namespaces; without them it falls back to loopback (see ``link``).

**The link.** The leader and the follower each run in their own Linux network namespace, joined
by a veth pair whose two ends are shaped with ``tc qdisc add dev X root tbf rate R ...``
(default 100 Mbit/s each way, at most 5 ms queued): ``link = {"kind": "netns-veth-tbf",
"rate_mbit": R, ...}``. When namespaces cannot be made (not root, no ``ip``/``tc``, a
container without ``CAP_NET_ADMIN``), both processes run on 127.0.0.1 and each `HttpTransport`
paces its outgoing bodies to the same rate (``HttpConfig.shape_bandwidth``):
``link = {"kind": "loopback-shaped", ..., "fallback_reason": ...}``. ``--link netns`` /
``--link loopback`` force one. Every connection across the veth pair uses ``--tcp-cc``
(cubic by default, a route attribute; ``tcp_congestion_control`` in the JSON), and
``link_counters`` holds each end's qdisc drops and each namespace's TCP retransmission
counters for the run. Namespaces are removed on every exit path (try/finally,
Ctrl-C, SIGTERM); the role processes die with main (``PR_SET_PDEATHSIG``), and namespaces of
a SIGKILLed run are swept by the next run.

**The processes.** This process (``main``) sets up the link and starts the leader, then the
follower, with ``ip netns exec NS python -m bench.wan --role leader|follower`` (plain
``python -m ...`` on loopback); each prints its address as one JSON line, and main relays the
follower's address to the leader. They talk only through `HttpTransport` (HMAC with a random
secret passed in the environment) and one raw TCP probe socket; nothing is pickled.
``--print-commands`` prints both processes' command lines (as on loopback) and starts nothing;
``--size-only`` runs step 2 below alone, for the configured rate, and prints its widths.

**The workload** (``two_party`` topology, as ``bench.pipeline``): the follower ``A`` holds the
features and a bottom MLP ``d_in -> hidden -> cut``; the leader ``B`` holds a small top MLP, the
labels and the loss. One batch carries ``batch_size x cut`` float32 activations each way.

1. The leader measures the link's goodput in each direction with the raw TCP probe (a large
   message and a one-byte ack); on loopback the configured rate is used instead.
2. It sizes the workload so that link time ~= compute time: the hidden width is searched
   (`size_workload`) until the compute per batch (both parties' compute-lane busy time at
   n = 1, measured in-process on an unshaped link, as ``bench.pipeline`` measures it; the
   fastest of 3 batches) is within 15 % of one direction's link time per batch. ``--hidden``
   skips this.
3. It sends the workload description (JSON) to the follower; both build their `SplitParty`.
4. Compile (one batch at n = 1, 2, 4, ..., 64 and each swept n), let the auto tuner settle
   (``fit``), then ``repeats`` timed rounds, interleaved: sequential, each fixed n, auto.

**Reported** (medians over the rounds; a run ends when *both* processes finished their last
batch, taken from ``time.perf_counter`` — CLOCK_MONOTONIC, shared by the processes; ``load``
records ``os.getloadavg()``; docs/wan-bench.md has the details and current figures):

* ``sequential_s``: n = 1, FIFO policy on both parties;
* ``pipelined_s``: priority policy, automatic n (``SplitParty.fit``, ``groups="auto"``);
  ``n_groups`` is the tuner's n; ``sweep`` and ``best_fixed_n`` give the fixed-n times;
* ``bound_s``: ``max(busy(A compute), busy(B compute), bytes(A->B)/bw(A->B),
  bytes(B->A)/bw(B->A))`` from the auto runs' traces (each process traces its own party):
  compute busy sums the durations of the party's compute-lane events; bytes sums the tensor
  bytes of its ``send->PEER`` events (frame and HTTP headers excluded); ``bw`` is the measured
  goodput of that direction. No schedule can finish before its busiest resource has done its
  work. The terms are in ``bound_terms``. With ``--rtt-ms`` one measured round trip per batch
  is added (``bound_round_trips_s``): exact training makes every batch wait for its last
  gradient before the next batch's first forward, a chain that crosses the link both ways.

**Round trip** (``--rtt-ms R``): ``netem delay R/2`` in front of each end's ``tbf`` where the
kernel has netem, else a delaying TCP relay (`bench.relay`) in the follower's namespace (or on
loopback) carrying every connection between the parties; ``rtt_via`` says which, ``rtt_ms``
is the round trip measured through the path (docs/wan-bench.md, "Round-trip delay").
* ``speedup = sequential_s / pipelined_s`` (target >= 1.7); ``efficiency = bound_s /
  pipelined_s`` (target >= 0.85).

**Compression** (``--compress bfloat16|int8|topk``): both parties send every activation and
gradient through that cut compressor in every phase (``[train] compress``); the workload is
still sized on the exact float32 cut bytes, so a compressed run at the same seed times the same
model as an exact one, and its link terms shrink with the bytes; ``workload.compress`` says
which.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from tandem.transports.netns import LinkSetupError, NetnsLink
from tandem.transports.relay import buffer_for

A, B = "A", "B"  # A: follower (features, bottom); B: leader (top, labels, loss)
BENCH = "bench"  # channel of the benchmark's own control messages
SECRET_ENV = "TANDEM_WAN_SECRET"
MiB = 1 << 20


def _log(who: str, msg: str) -> None:
    print(f"[bench.wan {who}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# main: set up the link, start the two processes, relay addresses, print the result
# ---------------------------------------------------------------------------------------------
def _die_with_parent() -> None:  # in the child, before exec (kept across exec)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the parent's finally still terminates its children


def _child(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start a role process; it gets SIGTERM if this process dies without cleaning up."""
    return subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=_die_with_parent,
    )


class _RelayProcess:
    """A `bench.relay` process (``prefix`` runs it, e.g. inside a namespace), holding each
    direction ``one_way_ms`` with ``buffer_bytes`` per connection and direction; routes are
    added one at a time over its stdin."""

    def __init__(
        self, prefix: list[str], one_way_ms: float, buffer_bytes: int, env: dict[str, str]
    ) -> None:
        self.proc = _child(
            [
                *prefix,
                "-m",
                "bench.relay",
                f"--one-way-ms={one_way_ms:g}",
                f"--buffer-bytes={buffer_bytes}",
            ],
            env,
        )

    def route(self, listen: str, host: str, port: int) -> int:
        """Forward ``listen:P`` to ``host:port`` from now on; returns ``P``."""
        self.proc.stdin.write(json.dumps({"listen": listen, "target": [host, port]}) + "\n")
        self.proc.stdin.flush()
        return int(_read_line(self.proc, "relay")["port"])

    def url(self, listen: str, url: str) -> str:
        """A URL reaching the server at ``url`` through the relay, listening on ``listen``."""
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        return f"http://{listen}:{self.route(listen, host, int(port))}"

    def close(self) -> None:
        """End the relay (it returns when its stdin closes) and wait for it."""
        self.proc.stdin.close()
        self.proc.wait(timeout=20)


def _host_congestion_control() -> str:
    try:
        with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def _read_line(proc: subprocess.Popen, what: str) -> dict[str, Any]:
    line = proc.stdout.readline()
    if not line:
        code = proc.wait()
        raise RuntimeError(
            f"the {what} process exited (code {code}) before sending its "
            "result; its error is above on stderr"
        )
    return json.loads(line)


def role_commands(args: argparse.Namespace, link: NetnsLink | None) -> tuple[list[str], list[str]]:
    """The leader's and the follower's command lines (the follower's still lacks
    ``--peer-url``): each option in `_FORWARDED` that is set, in both, inside ``link``'s
    namespaces, or on loopback with in-transport shaping when ``link`` is None. What
    ``--print-commands`` prints."""
    me = [sys.executable, "-m", "bench.wan"]
    common = [
        f"--{k.replace('_', '-')}=" + (",".join(map(str, v)) if isinstance(v, tuple) else str(v))
        for k, v in vars(args).items()
        if k in _FORWARDED and v is not None
    ]
    if link is not None:
        lead_cmd = [*link.prefix(B), *me, "--role", "leader", "--host", link.ip[B], *common]
        fol_cmd = [*link.prefix(A), *me, "--role", "follower", "--host", link.ip[A], *common]
    else:
        shape = [f"--shape-Bps={args.rate_mbit * 1e6 / 8}"]
        lead_cmd = [*me, "--role", "leader", "--host", "127.0.0.1", *shape, *common]
        fol_cmd = [*me, "--role", "follower", "--host", "127.0.0.1", *shape, *common]
    return lead_cmd, fol_cmd


def run_main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole benchmark from the parent process; returns the result dict."""
    t_start = time.perf_counter()
    link: NetnsLink | None = None
    reason = None
    procs: list[subprocess.Popen] = []

    def on_term(signum, frame):  # SIGTERM: unwind through the finally blocks below
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        if args.link in ("auto", "netns"):
            if stale := NetnsLink.remove_stale():
                _log("main", f"removed namespaces left by killed runs: {stale}")
            try:
                link = NetnsLink(
                    args.rate_mbit,
                    latency_ms=args.tbf_latency_ms,
                    burst=args.tbf_burst,
                    tcp_cc=None if args.tcp_cc == "default" else args.tcp_cc,
                ).__enter__()
            except LinkSetupError as exc:
                if args.link == "netns":
                    raise
                reason = str(exc)
                _log(
                    "main",
                    f"network namespaces unavailable ({reason}); falling back to "
                    "loopback with in-transport shaping",
                )
        rtt_via, netem_reason = "none", None
        if args.rtt_ms > 0 and link is not None:
            netem_reason = link.add_delay(args.rtt_ms / 2)
            rtt_via = "netem" if netem_reason is None else "relay"
            if netem_reason is not None:
                _log("main", f"no netem ({netem_reason}); a delaying relay goes in the path")
        elif args.rtt_ms > 0:
            rtt_via = "relay"
        env = {**os.environ, SECRET_ENV: secrets.token_hex(16), "PYTHONUNBUFFERED": "1"}
        me = [sys.executable, "-m", "bench.wan"]
        lead_cmd, fol_cmd = role_commands(args, link)
        relay = None
        if rtt_via == "relay":  # in the follower's namespace: both directions cross it
            relay = _RelayProcess(
                [*(link.prefix(A) if link is not None else []), *me[:1]],
                args.rtt_ms / 2,
                buffer_for(args.rate_mbit * 1e6 / 8, args.rtt_ms / 2e3),
                env,
            )
            procs.append(relay.proc)
        leader = _child(lead_cmd, env)
        procs.append(leader)
        lead_addr = _read_line(leader, "leader")
        lead_url = lead_addr["url"]
        if relay is not None:  # the follower reaches the leader through the relay
            lead_url = relay.url("127.0.0.1", lead_url)
        follower = _child([*fol_cmd, "--peer-url", lead_url], env)
        procs.append(follower)
        fol_addr = _read_line(follower, "follower")
        if relay is not None:  # and the leader reaches the follower (and its probe) so too
            fol_host = link.ip[A] if link is not None else "127.0.0.1"
            fol_addr = {
                "url": relay.url(fol_host, fol_addr["url"]),
                "probe_port": relay.route(fol_host, fol_host, fol_addr["probe_port"]),
            }
        leader.stdin.write(json.dumps(fol_addr) + "\n")
        leader.stdin.flush()
        result = _read_line(leader, "leader")
        for p, what in ((leader, "leader"), (follower, "follower")):
            code = p.wait(timeout=60)
            if code != 0:
                raise RuntimeError(f"the {what} process exited with code {code}")
        if relay is not None:
            relay.close()
        if link is not None:
            result["link_counters"] = link.counters()
        result["rtt_via"] = rtt_via
        if netem_reason is not None:
            result["rtt_relay_reason"] = f"netem unavailable: {netem_reason}"
        result["tcp_congestion_control"] = (
            link.congestion_control() if link is not None else _host_congestion_control()
        )
        result["link"] = {
            **(
                link.describe()
                if link is not None
                else {
                    "kind": "loopback-shaped",
                    "rate_mbit": args.rate_mbit,
                    "shaping": "HttpConfig.shape_bandwidth (sender-side pacing)",
                    "fallback_reason": reason or "--link loopback",
                }
            ),
            **result.pop("link_measured"),
        }
        result["bench_s"] = time.perf_counter() - t_start
        return result
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            for f in (p.stdin, p.stdout):
                if f is not None and not f.closed:
                    try:
                        f.close()
                    except OSError:
                        pass
        if link is not None:
            link.close()
        signal.signal(signal.SIGTERM, old)


# options main forwards to both processes
#: `tandem.parties.split.compress.KINDS`, spelled out: importing the split package here would
#: load JAX in the main process, which only sets up the link
COMPRESS_KINDS = ("none", "bfloat16", "int8", "topk")
_FORWARDED = (
    "batch_size",
    "batches",
    "repeats",
    "d_in",
    "hidden",
    "cut",
    "top_hidden",
    "sweep",
    "tune_epochs",
    "seed",
    "probe_mib",
    "rate_mbit",
    "rtt_ms",
    "trace",
    "compress",
    "chunks",
    "send_window",
)


# ---------------------------------------------------------------------------------------------
# the raw TCP probe: the link's goodput in each direction
# ---------------------------------------------------------------------------------------------
async def _probe_sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Serve probes: read ``up`` and ``down`` (u64 each), then ``up`` bytes; answer one byte,
    then ``down`` bytes. Repeats until the client closes."""
    buf = memoryview(bytearray(4 * MiB))
    try:
        while True:
            head = await reader.readexactly(16)
            up, down = int.from_bytes(head[:8], "little"), int.from_bytes(head[8:], "little")
            while up:
                chunk = await reader.read(min(up, len(buf)))
                if not chunk:
                    return
                up -= len(chunk)
            writer.write(b"k")
            while down:
                n = min(down, len(buf))
                writer.write(buf[:n])
                await writer.drain()
                down -= n
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def measure_rtt(host: str, port: int, pings: int = 10) -> float:
    """The path's round trip in seconds: the median of ``pings`` exchanges of a 16-byte probe
    head and its one-byte answer (the sink's protocol with nothing to send), after one that
    opens the connection."""
    reader, writer = await asyncio.open_connection(host, port)
    times = []
    try:
        for i in range(pings + 1):
            t0 = time.perf_counter()
            writer.write(bytes(16))
            await reader.readexactly(1)
            if i:
                times.append(time.perf_counter() - t0)
    finally:
        writer.close()
        await writer.wait_closed()
    return statistics.median(times)


async def measure_goodput(
    host: str, port: int, nbytes: int, rtt_s: float = 0.0
) -> tuple[float, float]:
    """(up, down) goodput in bytes/s: ``nbytes`` each way after a 1 MiB warm-up exchange.
    The upload is timed until its acknowledgement: ``rtt_s`` (the path's round trip) is taken
    off that time."""
    reader, writer = await asyncio.open_connection(host, port)
    payload = memoryview(bytearray(4 * MiB))

    async def exchange(up: int, down: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        writer.write(up.to_bytes(8, "little") + down.to_bytes(8, "little"))
        left = up
        while left:
            n = min(left, len(payload))
            writer.write(payload[:n])
            await writer.drain()
            left -= n
        await reader.readexactly(1)
        t1 = time.perf_counter()
        left = down
        while left:
            chunk = await reader.read(min(left, 4 * MiB))
            if not chunk:
                raise ConnectionError("probe sink closed early")
            left -= len(chunk)
        return t1 - t0, time.perf_counter() - t1

    try:
        await exchange(MiB, MiB)
        t_up, t_down = await exchange(nbytes, nbytes)
    finally:
        writer.close()
        await writer.wait_closed()
    return nbytes / max(t_up - rtt_s, 1e-9), nbytes / t_down


# ---------------------------------------------------------------------------------------------
# the workload
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Workload:
    """Everything both parties must agree on; travels as JSON in the leader's first frame."""

    batch_size: int
    batches: int
    d_in: int
    hidden: int
    cut: int
    top_hidden: int
    seed: int
    chunks: int = 1  # messages per group in the pipelined phases (the sequential sends whole)
    #: cut compression of every phase (`tandem.parties.split.compress`); ``cut_bytes`` stays
    #: the exact float32 size, so sizing picks the same model as an exact run's
    compress: str = "none"

    @property
    def rows(self) -> int:
        return self.batch_size * self.batches

    @property
    def cut_bytes(self) -> int:
        """Activation bytes one batch sends A -> B (and gradient bytes B -> A)."""
        return self.batch_size * self.cut * 4

    def data(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        x = rng.standard_normal((self.rows, self.d_in), dtype=np.float32)
        w = rng.standard_normal(self.d_in, dtype=np.float32)
        return x, (x @ w > 0).astype(np.float32)

    def models(self) -> dict[str, Any]:
        from tandem.engine.kernels import mlp_stage

        return {
            "bottom": mlp_stage([self.d_in], [self.hidden], self.cut),
            "top": mlp_stage([self.cut], [self.top_hidden], 1, activate_last=False),
        }

    def party(self, name: str, transport, x=None, y=None):
        from tandem.engine.topology import two_party
        from tandem.parties.split.party import SplitConfig, SplitParty

        cfg = SplitConfig(
            batch_size=self.batch_size,
            groups="auto",
            seed=self.seed,
            learning_rate=1e-3,
            loss="binary",
            chunks=self.chunks,
            compress=self.compress,
        )
        if name == A:
            return SplitParty(
                A, two_party(A, B), self.models(), transport, datasets={"train": x}, config=cfg
            )
        return SplitParty(
            B, two_party(A, B), self.models(), transport, labels={"train": y}, config=cfg
        )


async def compute_per_batch(wl: Workload, who: str, rounds: int = 3) -> float:
    """Both parties' compute-lane busy seconds per batch at n = 1 (FIFO), in this process on an
    unshaped memory link (the same measurement as ``bench.pipeline``'s warm-up). The fastest of
    ``rounds`` batches: other load on the machine only ever adds time."""
    from tandem.engine.lanes import ThreadLane
    from tandem.engine.trace import Trace
    from tandem.transports.memory import MemoryNetwork

    one = dataclasses.replace(wl, batches=1)
    x, y = one.data()
    net = MemoryNetwork()
    leader, follower = one.party(B, net.endpoint(B), y=y), one.party(A, net.endpoint(A), x=x)
    idx = np.arange(one.batch_size)
    per_batch: list[float] = []

    async def drive() -> None:
        async with ThreadLane("wan-calibrate") as lane:
            for r in range(rounds + 1):  # the first batch compiles
                tr = Trace()
                for p in (leader, follower):
                    p.config.policy, p.trace, p.config.chunks = "fifo", tr, 1
                await leader.run_batch(idx, n=1, lane=lane)
                while follower._batch < leader._batch:  # the follower's last backward
                    await asyncio.sleep(0.001)
                if r:
                    per_batch.append(tr.busy(A) + tr.busy(B))
        await leader.stop()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(follower.serve())
        tg.create_task(drive())
    return min(per_batch)


async def size_workload(
    wl: Workload,
    link_s: float,
    who: str,
    steps: int = 4,
    measure: Callable[[Workload, str], Awaitable[float]] = compute_per_batch,
) -> tuple[Workload, float, dict[int, float]]:
    """Choose the hidden width so that compute per batch is within 15 % of ``link_s``.

    Compute grows about linearly with the width: each step interpolates between the nearest
    measured widths on either side of ``link_s`` (secant), or scales the width by the ratio
    while all measurements lie on one side. After ``steps`` measurements the measured width
    closest to ``link_s`` is kept (never an unmeasured one). ``measure`` gives a workload's
    compute per batch (`compute_per_batch`; ``--compute-table`` looks it up instead).
    Returns the workload, its compute per batch and every width measured -> its compute, in
    the order measured."""
    seen: dict[int, float] = {}

    def pick(h: float) -> int:
        return int(min(16384, max(16, round(h / 16) * 16)))

    hidden = wl.hidden
    for _ in range(steps):
        seen[hidden] = c = await measure(dataclasses.replace(wl, hidden=hidden), who)
        _log(
            who,
            f"hidden={hidden}: compute/batch {c * 1e3:.0f} ms, link/batch "
            f"{link_s * 1e3:.0f} ms (ratio {link_s / c:.2f})",
        )
        if abs(link_s / c - 1) <= 0.15:
            break
        below = [h for h, t in seen.items() if t < link_s]
        above = [h for h, t in seen.items() if t >= link_s]
        if below and above:
            lo, hi = max(below, key=lambda h: seen[h]), min(above, key=lambda h: seen[h])
            slope = (seen[hi] - seen[lo]) / (hi - lo) if hi != lo else 0.0
            nxt = pick(lo + (link_s - seen[lo]) / slope) if slope > 0 else pick((lo + hi) / 2)
        else:
            nxt = pick(hidden * link_s / c)
        if nxt in seen:
            break
        hidden = nxt
    best = min(seen, key=lambda h: abs(math.log(link_s / seen[h])))
    return dataclasses.replace(wl, hidden=best), seen[best], seen


def size_only(args: argparse.Namespace) -> dict[str, Any]:
    """``--size-only``: `size_workload` for the configured rate (``cut_bytes`` per batch at
    ``--rate-mbit``, as on loopback), from ``--hidden`` (1024), measured in this process or
    looked up in ``--compute-table`` (a JSON object: width -> compute seconds per batch, e.g.
    another machine's measurements; a width it lacks is an error). No link, no processes."""
    wl = Workload(
        batch_size=args.batch_size,
        batches=1,
        d_in=args.d_in,
        hidden=args.hidden or 1024,
        cut=args.cut,
        top_hidden=args.top_hidden,
        seed=args.seed,
    )
    link_s = wl.cut_bytes / (args.rate_mbit * 1e6 / 8)
    measure: Callable[[Workload, str], Awaitable[float]] = compute_per_batch
    if args.compute_table is not None:
        with open(args.compute_table) as f:
            table = {int(k): float(v) for k, v in json.load(f).items()}

        async def lookup(w: Workload, who: str) -> float:
            if w.hidden not in table:
                raise SystemExit(
                    f"--compute-table {args.compute_table} has no width {w.hidden}; "
                    "the search picks multiples of 16 from 16 to 16384"
                )
            return table[w.hidden]

        measure = lookup
    sized, compute_s, seen = asyncio.run(size_workload(wl, link_s, "main", measure=measure))
    return {
        "link_per_batch_s": link_s,
        "hidden": sized.hidden,
        "compute_per_batch_s": compute_s,
        "measured": [[h, t] for h, t in seen.items()],
    }


# ---------------------------------------------------------------------------------------------
# the two processes
# ---------------------------------------------------------------------------------------------
def _transport(args: argparse.Namespace, name: str, peers: dict[str, str]):
    from tandem.transports.http import HttpConfig, HttpTransport

    secret = os.environ.get(SECRET_ENV)
    if not secret:
        raise SystemExit(
            f"--role {args.role} is started by `python -m bench.wan` (it passes "
            f"the shared secret in ${SECRET_ENV})"
        )
    return HttpTransport(
        HttpConfig(
            name=name,
            host=args.host,
            port=0,
            peers=peers,
            secret=secret.encode(),
            shape_bandwidth=args.shape_Bps,
            retry_timeout=60.0,
            send_window=args.send_window,
        )
    )


def _write_traces(directory: str, seq, auto, n: int) -> None:
    """Both parties' events of the last round: Chrome traces and one Gantt PNG."""
    from pathlib import Path

    from tandem.engine.trace import plot_gantt

    out = Path(directory)
    seq.write_chrome(out / "wan_sequential.json")
    auto.write_chrome(out / "wan_pipelined.json")
    plot_gantt(
        [("sequential (n=1, fifo)", seq), (f"pipelined (auto, n={n})", auto)], out / "wan_gantt.png"
    )
    _log("leader", f"traces written to {out}/wan_{{sequential,pipelined}}.json, wan_gantt.png")


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def _sent_bytes(trace, party: str, peer: str) -> int:
    return sum(e.nbytes for e in trace.events if e.party == party and e.lane == f"send->{peer}")


async def follower_main(args: argparse.Namespace) -> int:
    from tandem.engine.trace import Trace
    from tandem.errors import TransportClosedError
    from tandem.transports.base import Frame

    sink = await asyncio.start_server(_probe_sink, args.host, 0)
    try:
        async with _transport(args, A, {B: args.peer_url}) as t:
            _emit({"url": t.url, "probe_port": sink.sockets[0].getsockname()[1]})
            first = await t.recv(B, BENCH)
            wl = Workload(**first.meta["workload"])
            x, _ = wl.data()
            party = wl.party(A, t, x=x)
            await t.send(B, BENCH, Frame(meta={"ready": True}))
            while True:
                try:
                    msg = await t.recv(B, BENCH)
                except TransportClosedError:
                    return 0  # the leader left
                if msg.meta.get("cmd") == "done":
                    return 0
                tr = Trace()
                party.config.policy, party.trace = str(msg.meta["policy"]), tr
                done: list[float] = []

                async def mark(_cmd, done: list[float] = done) -> None:
                    done.append(time.perf_counter())  # each batch's end, not the stop message's

                batches = await party.serve(on_batch=mark)
                end = done[-1] if done else time.perf_counter()
                rep = {
                    "end": end,
                    "batches": batches,
                    "compute_s": tr.busy(A),
                    "sent_bytes": _sent_bytes(tr, A, B),
                }
                if msg.meta.get("events"):
                    rep["events"] = [dataclasses.astuple(e) for e in tr.events]
                await t.send(B, BENCH, Frame(meta=rep))
    finally:
        sink.close()
        await sink.wait_closed()


class _Leader:
    """The leader's side of the measurement protocol (see the module docstring)."""

    def __init__(self, t, party, wl: Workload) -> None:
        self.t, self.party, self.wl = t, party, wl

    async def phase(self, policy: str, run: Callable[[], Awaitable[None]], *, events: bool = False):
        """Run ``run()`` with ``policy`` on both parties; returns (wall, trace, follower's
        report). The wall ends when both processes are done. With ``events`` the follower's
        trace events are merged into the returned trace (both use CLOCK_MONOTONIC)."""
        from tandem.engine.trace import Trace, TraceEvent
        from tandem.transports.base import Frame

        await self.t.send(
            A, BENCH, Frame(meta={"cmd": "phase", "policy": policy, "events": events})
        )
        tr = Trace()
        self.party.config.policy, self.party.trace = policy, tr
        # the leader's chunks travel in each batch command; the sequential baseline sends whole
        self.party.config.chunks = 1 if policy == "fifo" else self.wl.chunks
        t0 = time.perf_counter()
        await run()
        mine = time.perf_counter()
        await self.party.stop()
        rep = dict((await self.t.recv(A, BENCH)).meta)
        if events:
            tr.extend(TraceEvent(*e) for e in rep.pop("events"))
        return max(mine, rep["end"]) - t0, tr, rep

    def fixed(self, lane, n: int, k: int | None = None):
        bs = self.wl.batch_size

        async def run() -> None:
            for i in range(k or self.wl.batches):
                await self.party.run_batch(np.arange(i * bs, (i + 1) * bs), n=n, lane=lane)

        return run

    def auto(self, epochs: int = 1, after_batch=None):
        async def run() -> None:
            await self.party.fit(epochs, after_batch=after_batch)

        return run


async def leader_main(args: argparse.Namespace) -> int:
    from tandem.engine.lanes import ThreadLane
    from tandem.transports.base import Frame

    load_start = list(os.getloadavg())
    async with _transport(args, B, {}) as t:
        _emit({"url": t.url})
        peer = json.loads(await asyncio.to_thread(sys.stdin.readline))
        t.add_peer(A, peer["url"])
        host = peer["url"].split("//", 1)[1].rsplit(":", 1)[0]
        wl = Workload(
            batch_size=args.batch_size,
            batches=args.batches,
            d_in=args.d_in,
            hidden=args.hidden or 1024,
            cut=args.cut,
            top_hidden=args.top_hidden,
            seed=args.seed,
            chunks=args.chunks,
            compress=args.compress,
        )
        # 1. the path's round trip and the link's goodput
        rtt_s = await measure_rtt(host, peer["probe_port"])
        _log("leader", f"round trip {rtt_s * 1e3:.2f} ms (requested {args.rtt_ms:g} ms)")
        # the bound counts one round trip per batch where one was put in the path
        bound_rtt_s = rtt_s if args.rtt_ms > 0 else 0.0
        if args.shape_Bps is None:
            up, down = await measure_goodput(
                host, peer["probe_port"], args.probe_mib * MiB, bound_rtt_s
            )
            source = f"raw TCP probe, {args.probe_mib} MiB each way"
        else:
            up = down = args.shape_Bps
            source = "configured shaping rate (loopback is not measured)"
        _log("leader", f"goodput B->A {up / 1e6:.2f} MB/s, A->B {down / 1e6:.2f} MB/s ({source})")
        link_s = wl.cut_bytes / min(up, down)
        # 2. size the workload: compute per batch ~= link time per batch
        if args.hidden is None:
            wl, calib, _ = await size_workload(wl, link_s, "leader")
        else:
            calib = None
        # 3. both parties build the job
        _, y = wl.data()
        party = wl.party(B, t, y=y)
        await t.send(A, BENCH, Frame(meta={"workload": dataclasses.asdict(wl)}))
        await t.recv(A, BENCH)
        lead = _Leader(t, party, wl)
        sweep = sorted({min(n, wl.batch_size) for n in args.sweep})
        async with ThreadLane("wan-leader") as lane:
            # 4. compile every shape used, then let the tuner settle
            # (the tuner's first batch runs at n = 4 and its rule reads that batch's compute
            # time, so every n it may start from or step to must be compiled first)
            shapes = sorted({1, *sweep, *(min(2**k, wl.batch_size) for k in range(7))})

            async def compile_all() -> None:
                for n in shapes:
                    await lead.fixed(lane, n, 1)()

            _log("leader", f"hidden={wl.hidden}; compiling group counts {shapes} ...")
            await lead.phase("priority", compile_all)
            # One `fit` call, epochs back to back as a user trains (bench.pipeline does the
            # same): a pause for the follower after every epoch made the batch after it faster
            # than the others and biased the tuner's means by where a probe began.

            async def until_settled(epoch: int, done: int) -> bool:
                return party.tuner_state.settled

            wall = (await lead.phase("priority", lead.auto(args.tune_epochs, until_settled)))[0]
            settled = party.tuner_state.settled
            _log("leader", f"tuning: {wall:.3f} s for {len(party.tuner_path)} batches")
            _log(
                "leader",
                f"tuner {'settled' if settled else 'NOT settled'} at "
                f"n={party.n_groups}: {[n for n, _ in party.tuner_path]}",
            )
            # 5. timed rounds, interleaved
            seq, auto, terms, seq_compute = [], [], [], []
            runs: dict[int, list[float]] = {n: [] for n in sweep}
            for r in range(args.repeats):
                last = args.trace is not None and r == args.repeats - 1
                wall, tr, rep = await lead.phase("fifo", lead.fixed(lane, 1), events=last)
                seq.append(wall)
                seq_trace = tr
                seq_compute.append((tr.busy(B) + rep["compute_s"]) / wl.batches)
                for n in sweep:
                    runs[n].append((await lead.phase("priority", lead.fixed(lane, n)))[0])
                wall, tr, rep = await lead.phase("priority", lead.auto(), events=last)
                auto.append(wall)
                if last:
                    _write_traces(args.trace, seq_trace, tr, party.n_groups)
                terms.append(
                    {
                        f"compute[{A}]": rep["compute_s"],
                        f"compute[{B}]": tr.busy(B),
                        f"link[{A}->{B}]": rep["sent_bytes"] / down,
                        f"link[{B}->{A}]": _sent_bytes(tr, B, A) / up,
                    }
                )
                _log(
                    "leader",
                    f"round {r + 1}/{args.repeats}: sequential {seq[-1]:.3f} s, auto "
                    f"(n={party.n_groups}) {auto[-1]:.3f} s, fixed "
                    + ", ".join(f"{n}: {runs[n][-1]:.3f}" for n in sweep),
                )
        await t.send(A, BENCH, Frame(meta={"cmd": "done"}))

    seq_s, pipe_s = statistics.median(seq), statistics.median(auto)
    bound_terms = {k: statistics.median(tm[k] for tm in terms) for k in terms[0]}
    round_trips_s = wl.batches * bound_rtt_s
    bound_s = max(bound_terms.values()) + round_trips_s
    sweep_s = {n: statistics.median(v) for n, v in runs.items()}
    best = min(sweep_s, key=sweep_s.get) if sweep_s else None
    result = {
        "bench": "wan",
        "sequential_s": seq_s,
        "pipelined_s": pipe_s,
        "bound_s": bound_s,
        "speedup": seq_s / pipe_s,
        "efficiency": bound_s / pipe_s,
        "n_groups": party.n_groups,
        "tuner_settled": settled,
        "tuner_path": [n for n, _ in party.tuner_path],
        "bound_terms": {
            "definition": "max over: each party's compute-lane busy seconds; each "
            "direction's send->PEER tensor bytes / measured goodput; "
            "from the auto runs' traces, median over rounds; "
            "plus bound_round_trips_s",
            **bound_terms,
        },
        "bound_round_trips_s": round_trips_s,
        "rtt_requested_ms": args.rtt_ms,
        "rtt_ms": rtt_s * 1e3,
        "send_window": args.send_window,
        "sweep": {str(n): s for n, s in sweep_s.items()},
        "best_fixed_n": best,
        "auto_vs_best": (sweep_s[best] / pipe_s) if best is not None else None,
        "best_fixed_s": sweep_s[best] if best is not None else None,
        "workload": {
            **dataclasses.asdict(wl),
            "topology": "two_party",
            "cut_bytes_per_batch": wl.cut_bytes,
            "compute_per_batch_s": statistics.median(seq_compute),
            "calibrated_compute_per_batch_s": calib,
            "link_per_batch_s": link_s,
        },
        "runs": {
            "sequential_s": seq,
            "pipelined_s": auto,
            **{f"n={n}": v for n, v in runs.items()},
        },
        "link_measured": {
            "goodput_MBps": {f"{B}->{A}": up / 1e6, f"{A}->{B}": down / 1e6},
            "goodput_source": source,
        },
        "loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
        "load": {
            "cpus": os.cpu_count(),
            "loadavg_start": load_start,
            "loadavg_end": list(os.getloadavg()),
        },
    }
    bad = [k for k, v in result.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise RuntimeError(f"non-finite results {bad}")
    _emit(result)
    return 0


# ---------------------------------------------------------------------------------------------
def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"group counts must be >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.wan", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON line on stdout")
    p.add_argument(
        "--link",
        choices=["auto", "netns", "loopback"],
        default="auto",
        help="auto: network namespaces if permitted, else loopback (default)",
    )
    p.add_argument("--rate-mbit", type=float, default=100.0, help="link rate each way (100)")
    p.add_argument(
        "--tbf-latency-ms",
        type=float,
        default=5.0,
        help="tbf queue size, as the longest wait in it (5 ms, an AQM-like queue; "
        "50 shows a bloated FIFO)",
    )
    p.add_argument(
        "--tbf-burst",
        type=int,
        default=None,
        help="tbf bucket in bytes (default: 2 ms at the rate, at least 64 KiB)",
    )
    p.add_argument(
        "--tcp-cc",
        default="cubic",
        help="TCP congestion control of every connection over the veth pair (cubic; "
        "'default': the kernel's; others in /proc/sys/net/ipv4/"
        "tcp_available_congestion_control); no effect on loopback",
    )
    p.add_argument(
        "--rtt-ms",
        type=float,
        default=0.0,
        help="round-trip delay added between the parties: netem where the kernel has it, "
        "else a delaying TCP relay in the path (0: none)",
    )
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--batches", type=int, default=3, help="batches per timed run (3)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (5)")
    p.add_argument("--d-in", type=int, default=512)
    p.add_argument(
        "--hidden",
        type=int,
        default=None,
        help="bottom hidden width (default: sized so compute ~= link time)",
    )
    p.add_argument("--cut", type=int, default=512, help="cut-layer width (512)")
    p.add_argument("--top-hidden", type=int, default=32)
    p.add_argument(
        "--sweep",
        type=_positive_ints,
        default=(8, 16, 32, 64),
        help="fixed group counts timed besides auto (8,16,32,64)",
    )
    p.add_argument(
        "--tune-epochs",
        type=int,
        default=50,
        help="most epochs of the one fit call waiting for the auto tuner to settle "
        "(50: a search that re-measures a close call takes up to about 100 "
        "batches)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--chunks",
        type=int,
        default=1,
        help="messages per group in the pipelined runs (1: whole groups)",
    )
    p.add_argument(
        "--send-window",
        type=int,
        default=8,
        help="HttpConfig.send_window of both parties: messages of a channel in flight (8)",
    )
    p.add_argument(
        "--compress",
        default="none",
        choices=COMPRESS_KINDS,
        help="cut-layer compression of every phase, as [train] compress (none: exact)",
    )
    p.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="write both parties' traces of the last round (Chrome JSON + Gantt PNG)",
    )
    p.add_argument("--probe-mib", type=int, default=16, help="bytes of the goodput probe")
    p.add_argument(
        "--size-only",
        action="store_true",
        help="size the hidden width for --rate-mbit as on loopback (from --hidden, 1024), "
        "print the widths measured (JSON), and exit without making a link",
    )
    p.add_argument(
        "--compute-table",
        metavar="FILE",
        help="with --size-only: a JSON object width -> compute seconds per batch, looked up "
        "instead of measuring (another machine's measurements)",
    )
    p.add_argument(
        "--print-commands",
        action="store_true",
        help="print the leader's and the follower's command lines as on loopback (JSON), "
        "and exit without making a link or starting them",
    )
    p.add_argument(
        "--role", choices=["main", "leader", "follower"], default="main", help=argparse.SUPPRESS
    )
    p.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--peer-url", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--shape-Bps", dest="shape_Bps", type=float, default=None, help=argparse.SUPPRESS
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in (
        "batch_size",
        "batches",
        "repeats",
        "d_in",
        "cut",
        "top_hidden",
        "probe_mib",
        "chunks",
        "send_window",
    ):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.tbf_latency_ms > 0:
        raise SystemExit(f"--tbf-latency-ms must be > 0, got {args.tbf_latency_ms}")
    if not args.rtt_ms >= 0:
        raise SystemExit(f"--rtt-ms must be >= 0, got {args.rtt_ms}")
    if not args.rate_mbit > 0:
        raise SystemExit(f"--rate-mbit must be > 0, got {args.rate_mbit}")
    if args.trace is not None:
        args.trace = os.path.abspath(args.trace)
    if args.compute_table is not None and not args.size_only:
        raise SystemExit("--compute-table is read by --size-only only; add --size-only")
    if args.size_only:
        print(json.dumps(size_only(args)))
        return 0
    if args.print_commands:
        leader, follower = role_commands(args, None)
        print(json.dumps({"leader": leader, "follower": follower}))
        return 0
    if args.role != "main":
        from tandem.parties.cli import run_async

        return run_async(
            lambda: (leader_main if args.role == "leader" else follower_main)(args),
            colocate_threads=True,
        )  # as `tandem party` runs
    try:
        result = run_main(args)
    except KeyboardInterrupt:
        print("interrupted; namespaces removed", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result))
    else:
        for key in (
            "sequential_s",
            "pipelined_s",
            "bound_s",
            "speedup",
            "efficiency",
            "n_groups",
            "link",
        ):
            print(f"{key:>14}: {result[key]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
