"""Pipeline benchmark: sequential vs prioritised micro-batch pipeline on a shaped link.

``python -m bench.pipeline --json`` prints ONE JSON line (progress goes to stderr).

Workload: the ``two_party`` topology (party ``A`` holds a bottom MLP over synthetic float32
features; party ``B`` holds a small top MLP, the labels and the loss). Compute per batch is
measured on an unshaped link (n = 1, both parties' compute busy time, median over
``warmup`` batches: 20, as a shared machine's speed drifts in spells of about a second), then
both directions of the ``A <-> B`` link are shaped so that one direction carries a batch's
cut-layer tensor (``batch x cut x 4`` bytes) in that time: link time per direction ~= compute
time per batch, on whatever machine runs it (``--link-ratio r`` makes it ``r`` times that).
``link_vs_compute`` reports the ratio the timed rounds had (link per batch / the compute per
batch of the round's sequential run, median over rounds): this machine's speed drifts, so it
strays from 1. ``--recalibrate K`` measures the compute again before every timed round (``K``
batches) and re-shapes the link from it; off by default, since the tuner's choice was made
under the first link.

Reported (all times are medians over ``repeats`` timed runs of ``batches`` batches each; a run
ends when *both* parties have finished their last batch):

* ``sequential_s``: n = 1 with the FIFO policy on both parties (no pipelining, no priorities).
* ``pipelined_s``: the priority policy with the automatic group count: ``SplitParty.fit``
  with ``groups="auto"`` (the `tandem.engine.microbatch.GroupTuner` re-tunes between batches) is run
  until the tuner settles and has gone through ``--tune-rechecks`` (1) re-checks, its steady
  state (one ``fit`` call, epochs back to back, as a user trains), then timed over the same
  number of batches. ``tuner_first_n`` is the count its first search settled on.
* ``bound_s``: a lower bound on the pipelined time, measured from the pipelined run's `Trace`:
  ``max(busy(A compute), busy(B compute), bytes(send->B)/bandwidth, bytes(send->A)/bandwidth)``
  where ``busy`` sums the durations of a party's compute-lane events and ``bytes`` sums the
  tensor bytes (``array.nbytes``; frame headers excluded) of the ``send->PEER`` events. No
  schedule can finish before its busiest resource has done its work. The terms are in
  ``bound_terms``.
* ``speedup`` = sequential / pipelined; ``efficiency`` = bound / pipelined.
* ``sweep``: n -> seconds for fixed n (priority policy); ``best_fixed_n`` the fastest of
  these medians. The timed runs are interleaved round by round (sequential, then every fixed
  n in ascending order with the auto run next to the fixed run of the tuner's n,
  `round_order`), so load drifting on a shared machine hits every variant alike, and
  ``auto_vs_best`` = best swept time / auto time is taken within each round and the median
  reported (paired, as ``unchunked_efficiency`` is). ``auto_vs_best_of_medians`` is the ratio
  of the two medians instead. ``--print-plan`` prints these orders and runs nothing.
* ``overhead_us_per_op``: the engine's own cost per plan op (F/L/B/U compute ops *and* S/R
  sends/receives, both parties), with a tiny model on an unshaped memory link and many
  micro-batches: median over interleaved pairs of (runtime wall time - baseline) / ops, where
  the baseline runs the very same
  ``StageHandler.compute``/``receive`` calls (the same jitted kernels) serially in a plain loop
  with no runtime, lanes or transport. ``overhead_us_per_compute_op`` divides by compute ops
  only.
* ``chunks``: messages per group in the pipelined runs (``--chunks``; `tandem.engine.plan`):
  the loss party computes per message, so a group's gradient starts back after its first part.
  ``unchunked_s`` runs the tuner's n with whole groups in the same rounds, and
  ``unchunked_efficiency`` is its bound / time (median of per-round ratios): what chunking buys.
* ``python_threads_cpu``: the CPU the event loop's thread and the compute lanes are pinned to,
  as the ``tandem`` commands pin them (`tandem.parties.cli.affinity`; ``TANDEM_PYTHON_CPU=off``
  runs the whole benchmark unpinned, and then this is null). When pinned, the overhead is
  measured once more with the threads free to move: ``overhead_unpinned_us_per_op``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import math
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tandem.engine.kernels import mlp_stage
from tandem.engine.lanes import ThreadLane
from tandem.engine.microbatch import group_bounds
from tandem.engine.plan import Kind, Op
from tandem.engine.simulator import Link, replay
from tandem.engine.topology import two_party
from tandem.engine.trace import Trace, plot_gantt
from tandem.errors import ConfigError
from tandem.parties.cli.affinity import colocate_python_threads, thread_cpus
from tandem.parties.split.party import SplitConfig, SplitParty
from tandem.transports.memory import MemoryNetwork

A, B = "A", "B"  # A: bottom model + features; B: top model + labels (the leader)


@dataclasses.dataclass
class BenchConfig:
    """Sizes of the benchmark. The defaults take about 80 s on a 2-core machine."""

    batch_size: int = 2048
    batches: int = 3  # batches per timed run
    repeats: int = 9  # timed rounds (medians reported)
    d_in: int = 512
    hidden: tuple[int, ...] = (1024,)
    cut: int = 512
    top_hidden: tuple[int, ...] = (32,)
    chunks: int = 4  # messages per group in the pipelined runs
    latency: float = 0.001
    link_ratio: float = 1.0  # link time per batch / measured compute per batch
    warmup: int = 20  # unshaped n = 1 batches measuring compute before tuning
    recalibrate: int = 0  # the same, before every timed round (0: calibrate once)
    sweep: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    tune_rechecks: int = 1  # re-checks the tuner goes through before the timed rounds
    tune_epochs: int = 120  # most epochs of `fit` waiting for the tuner to settle
    seed: int = 0
    # overhead measurement (tiny model, unshaped link)
    overhead_batch: int = 64
    overhead_groups: int = 64
    overhead_batches: int = 10
    overhead_width: int = 4

    @property
    def swept(self) -> list[int]:
        """The fixed counts the timed rounds run: `sweep` capped at the batch size."""
        return sorted({min(n, self.batch_size) for n in self.sweep})

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.batches < 1 or self.repeats < 1:
            raise ConfigError("batch_size, batches and repeats must be >= 1")
        if not (self.link_ratio > 0 and math.isfinite(self.link_ratio)):
            raise ConfigError(
                f"link_ratio must be a positive number (link time per batch / "
                f"compute time per batch), got {self.link_ratio!r}"
            )
        if self.tune_rechecks < 0:
            raise ConfigError(
                f"tune_rechecks counts the tuner's re-checks before the timed "
                f"rounds and must be >= 0, got {self.tune_rechecks}"
            )
        if self.warmup < 1 or self.recalibrate < 0:
            raise ConfigError(
                f"warmup must be >= 1 and recalibrate >= 0 batches, got "
                f"{self.warmup} and {self.recalibrate}"
            )
        if not self.sweep or min(self.sweep) < 1:
            raise ConfigError(f"sweep must list group counts >= 1, got {self.sweep!r}")
        if not 1 <= self.overhead_groups <= self.overhead_batch:
            raise ConfigError("overhead_groups must be in [1, overhead_batch]")


#: ``--quick``: a tiny model and few batches, seconds in all (the smoke test's size)
QUICK = dict(
    batch_size=16,
    batches=2,
    repeats=2,
    d_in=8,
    hidden=(16,),
    cut=8,
    top_hidden=(4,),
    warmup=1,
    recalibrate=1,
    sweep=(1, 4),
    tune_epochs=100,
    overhead_batch=8,
    overhead_groups=8,
    overhead_batches=2,
)


def _log(msg: str) -> None:
    print(f"[bench.pipeline] {msg}", file=sys.stderr, flush=True)


# -- the workload --------------------------------------------------------------------------------
class Workload:
    """Two parties on one `MemoryNetwork`, B leading, A serving (see the module docstring)."""

    def __init__(
        self,
        *,
        batch_size: int,
        n_batches: int,
        d_in: int,
        hidden,
        cut: int,
        top_hidden,
        seed: int,
        groups="auto",
        chunks: int = 1,
    ) -> None:
        rng = np.random.default_rng(seed)
        rows = batch_size * n_batches
        x = rng.standard_normal((rows, d_in), dtype=np.float32)
        w = rng.standard_normal(d_in, dtype=np.float32)
        y = (x @ w > 0).astype(np.float32)
        self.topology = two_party(A, B)
        self.models = {
            "bottom": mlp_stage([d_in], list(hidden), cut),
            "top": mlp_stage([cut], list(top_hidden), 1, activate_last=False),
        }
        self.cfg = SplitConfig(
            batch_size=batch_size,
            groups=groups,
            seed=seed,
            learning_rate=1e-3,
            loss="binary",
            chunks=chunks,
        )
        self.chunks = chunks
        self.net = MemoryNetwork()
        self.leader = SplitParty(
            B,
            self.topology,
            self.models,
            self.net.endpoint(B),
            labels={"train": y},
            config=self.cfg,
        )
        self.follower = SplitParty(
            A,
            self.topology,
            self.models,
            self.net.endpoint(A),
            datasets={"train": x},
            config=dataclasses.replace(self.cfg),
        )
        self.rows = rows
        self.cut = cut

    @property
    def parties(self) -> tuple[SplitParty, SplitParty]:
        return self.leader, self.follower

    def batch_indices(self, k: int) -> list[np.ndarray]:
        bs = self.cfg.batch_size
        return [np.arange(i * bs, (i + 1) * bs) for i in range(k)]

    def set(self, *, policy: str, trace: Trace | None, chunks: int | None = None) -> None:
        """Policy and trace of the next runs; ``"fifo"`` (the sequential baseline) also sends
        each group whole (chunks = 1), ``"priority"`` in the workload's chunks unless
        ``chunks`` says otherwise."""
        for p in self.parties:
            p.config.policy, p.trace = policy, trace
            p.config.chunks = 1 if policy == "fifo" else chunks or self.chunks

    async def synced(self) -> None:
        """Wait until the follower has finished every batch the leader started (the leader's
        ``run_batch`` returns once its own ops are done, before the follower's last backward)."""
        await self.follower.wait_batches(self.leader.batches_done)

    async def run_fixed(self, lane: ThreadLane, n: int, idx_list) -> float:
        t0 = time.perf_counter()
        for idx in idx_list:
            await self.leader.run_batch(idx, n=n, lane=lane)
        await self.synced()
        return time.perf_counter() - t0

    async def run_auto_epoch(self) -> float:
        t0 = time.perf_counter()
        await self.leader.fit(1)
        await self.synced()
        return time.perf_counter() - t0


def _bound(trace: Trace, bandwidth: float) -> tuple[float, dict[str, float]]:
    terms: dict[str, float] = {}
    for party in (A, B):
        terms[f"compute[{party}]"] = trace.busy(party, "compute")
    for party, peer in ((A, B), (B, A)):
        nbytes = sum(
            e.nbytes for e in trace.events if e.party == party and e.lane == f"send->{peer}"
        )
        terms[f"link[{party}->{peer}]"] = nbytes / bandwidth
    return max(terms.values()), terms


def _schedule(trace: Trace, wl: Workload, n: int, bandwidth: float, latency: float) -> float:
    """The makespan of one batch that the engine's own schedule allows with zero engine cost:
    `tandem.engine.simulator.replay` of both parties' plans at ``n`` (same policy and
    backpressure) at the costs ``trace`` measured, on the benchmark's link. What separates it
    from ``pipelined_s`` is the engine's cost; what separates ``bound_s`` from it is the
    schedule's (fill, drain and the gradient link trailing the activation link by a group)."""
    chunks = wl.leader.chunks_for(wl.cfg.batch_size, n)
    plans = {p.name: p.plan(n, "train", chunks) for p in wl.parties}
    bp = wl.leader.config.backpressure.scaled(chunks)
    link = Link(bandwidth, latency)
    return replay(trace, plans, links=lambda src, dst: link, bp=bp).makespan


def round_order(ns, n_auto: int, r: int) -> list[int | None]:
    """The pipelined runs of timed round ``r``: the fixed counts ``ns`` in ascending order, and
    the auto run (``None``) in its place among them, next to the fixed run of the tuner's count
    ``n_auto``: after it in even rounds, before it in odd ones (where ``n_auto`` is not swept,
    between its neighbours).

    ``auto_vs_best`` pairs the auto run with the best fixed count's run of the same round, and
    a shared machine's speed drifts in spells of about a second, so runs timed next to each
    other share a spell while runs a second apart do not. Alternating the side spreads
    whatever the run before leaves behind over both."""
    below = [n for n in ns if n < n_auto or (n == n_auto and r % 2 == 0)]
    return [*below, None, *[n for n in ns if n not in below]]


def timed_rounds(cfg: BenchConfig) -> dict[str, Any]:
    """What ``--print-plan`` prints: the swept counts (`BenchConfig.swept`) and, for each
    count 1..``batch_size`` the tuner may settle on, the `round_order` of every timed round,
    the auto run as ``"auto"``."""
    ns = cfg.swept
    return {
        "sweep": ns,
        "repeats": cfg.repeats,
        "round_orders": {
            str(n_auto): [
                ["auto" if n is None else n for n in round_order(ns, n_auto, r)]
                for r in range(cfg.repeats)
            ]
            for n_auto in range(1, cfg.batch_size + 1)
        },
    }


# -- the pipeline measurement ---------------------------------------------------------------------
async def measure_pipeline(
    cfg: BenchConfig,
    log: Callable[[str], None] = _log,
    plot: str | None = None,
    trace: str | None = None,
) -> dict[str, Any]:
    wl = Workload(
        batch_size=cfg.batch_size,
        n_batches=cfg.batches,
        d_in=cfg.d_in,
        hidden=cfg.hidden,
        cut=cfg.cut,
        top_hidden=cfg.top_hidden,
        seed=cfg.seed,
        chunks=cfg.chunks,
    )
    out: dict[str, Any] = {}

    async def drive() -> None:
        idx_list = wl.batch_indices(cfg.batches)
        async with ThreadLane("bench-leader") as lane:
            # 1. compile n = 1 and every swept group shape (one untimed batch each)
            wl.set(policy="fifo", trace=None)
            await wl.run_fixed(lane, 1, idx_list[:1])
            wl.set(policy="priority", trace=None)
            ns = cfg.swept
            for n in ns:
                await wl.run_fixed(lane, n, idx_list[:1])

            # 2. compute per batch (n = 1, unshaped link), and the link shaped from it
            link_bytes = cfg.batch_size * cfg.cut * 4

            async def calibrate(k: int) -> tuple[float, float]:
                """(compute per batch, bandwidth): the median over ``k`` unshaped n = 1 FIFO
                batches of both parties' compute busy time, and the bandwidth that carries a
                batch's cut tensor in ``link_ratio`` times that. Leaves the link so shaped
                and the parties on FIFO: each caller sets the policy of what it runs next."""
                wl.net.shape(A, B, bandwidth=None, latency=0.0, both=True)
                per_batch = []
                for i in range(k):
                    tr = Trace()
                    wl.set(policy="fifo", trace=tr)
                    await wl.run_fixed(lane, 1, idx_list[i % len(idx_list) :][:1])
                    per_batch.append(tr.busy(A) + tr.busy(B))
                compute = statistics.median(per_batch)
                bandwidth = link_bytes / (compute * cfg.link_ratio)
                wl.net.shape(A, B, bandwidth=bandwidth, latency=cfg.latency, both=True)
                return compute, bandwidth

            compute, bandwidth = await calibrate(cfg.warmup)
            log(
                f"compute/batch {compute * 1e3:.1f} ms -> bandwidth {bandwidth / 1e6:.2f} MB/s "
                f"({link_bytes} B per direction per batch)"
            )
            out["workload"] = {
                "topology": "two_party",
                "batch_size": cfg.batch_size,
                "batches": cfg.batches,
                "repeats": cfg.repeats,
                "d_in": cfg.d_in,
                "hidden": list(cfg.hidden),
                "cut": cfg.cut,
                "top_hidden": list(cfg.top_hidden),
                "chunks": cfg.chunks,
                "compute_per_batch_s": compute,
                "cut_bytes_per_batch": link_bytes,
                "link_ratio": cfg.link_ratio,
                "link_per_batch_s": link_bytes / bandwidth,
            }
            out["link"] = {"bandwidth_Bps": bandwidth, "latency_s": cfg.latency}

            # 3. auto: let the tuner settle (fit re-tunes between full batches). One `fit` call,
            #    as a user trains: no pause between epochs, so every batch's wall carries the
            #    previous batch's leftover work (a pause for the follower would make the batch
            #    after it faster and bias the tuner's means by where a probe began).
            #    The tuner goes on through ``tune_rechecks`` re-checks (`GroupTuner.recheck`
            #    batches apart) before the timing: its steady state, which a user's training
            #    reaches within a few hundred batches.
            leader = wl.leader
            wl.set(policy="priority", trace=None)
            settles, was_settled, first_n = 0, False, None

            async def until_settled(epoch: int, done: int) -> bool:
                nonlocal settles, was_settled, first_n
                if leader.tuner_state.settled and not was_settled:
                    settles += 1
                    first_n = first_n or wl.leader.n_groups
                was_settled = leader.tuner_state.settled
                return settles > cfg.tune_rechecks

            await wl.leader.fit(cfg.tune_epochs, after_batch=until_settled)
            await wl.synced()
            settled = leader.tuner_state.settled
            log(
                f"tuner {'settled' if settled else 'NOT settled'} at n={wl.leader.n_groups} "
                f"(first search: {first_n}) after {len(leader.tuner_path)} batches: "
                f"{[n for n, _ in leader.tuner_path]}"
            )

            # 4. timed rounds, interleaved so that load drifting on a shared machine hits every
            #    variant alike: sequential (n=1, FIFO), each fixed n, auto (fit, tuner live).
            #    With ``recalibrate`` each round first re-measures the compute and re-shapes
            #    the link from it (off by default).
            seq, auto, bounds, seq_trace, pipe_trace = [], [], [], None, None
            schedules: list[float] = []  # `_schedule` of each auto run that kept one n
            runs: dict[int, list[float]] = {n: [] for n in ns}
            whole: list[tuple[float, float]] = []  # the tuner's n, groups unchunked: (s, bound)
            calibration: dict[str, list[float]] = {
                "compute_s": [],
                "link_s": [],
                "sequential_compute_s": [],
            }
            for r in range(cfg.repeats):
                if cfg.recalibrate:
                    compute, bandwidth = await calibrate(cfg.recalibrate)
                calibration["compute_s"].append(compute)
                calibration["link_s"].append(link_bytes / bandwidth)
                tr = Trace()
                wl.set(policy="fifo", trace=tr)
                seq.append(await wl.run_fixed(lane, 1, idx_list))
                calibration["sequential_compute_s"].append((tr.busy(A) + tr.busy(B)) / cfg.batches)
                seq_trace = seq_trace or tr
                for n in round_order(ns, wl.leader.n_groups, r):
                    if n is not None:  # traced like the auto run (whose trace gives the
                        wl.set(policy="priority", trace=Trace())  # bound): the same cost
                        runs[n].append(await wl.run_fixed(lane, n, idx_list))
                        continue
                    tr = Trace()
                    wl.set(policy="priority", trace=tr)
                    auto.append(await wl.run_auto_epoch())
                    bounds.append(_bound(tr, bandwidth))
                    pipe_trace = pipe_trace or tr
                    if all(n == wl.leader.n_groups for n, _ in leader.tuner_path[-cfg.batches :]):
                        schedules.append(
                            cfg.batches
                            * _schedule(tr, wl, wl.leader.n_groups, bandwidth, cfg.latency)
                        )
                if cfg.chunks > 1:  # what chunking buys, measured in the same round
                    tr = Trace()
                    wl.set(policy="priority", trace=tr, chunks=1)
                    whole.append(
                        (
                            await wl.run_fixed(lane, wl.leader.n_groups, idx_list),
                            _bound(tr, bandwidth)[0],
                        )
                    )
                log(
                    f"round {r + 1}/{cfg.repeats}: link {link_bytes / bandwidth * 1e3:.1f} "
                    f"ms/batch, sequential {seq[-1]:.3f} s, auto "
                    f"(n={wl.leader.n_groups}) {auto[-1]:.3f} s, fixed "
                    + ", ".join(f"{n}: {runs[n][-1]:.3f}" for n in ns)
                )
            sweep = {n: statistics.median(t) for n, t in runs.items()}
        wl.set(policy="priority", trace=None)
        await wl.leader.stop()

        seq_s, pipe_s = statistics.median(seq), statistics.median(auto)
        terms = {k: statistics.median(t[k] for _, t in bounds) for k in bounds[0][1]}
        bound_s = max(terms.values())
        best_n = min(sweep, key=sweep.get)
        schedule_s = statistics.median(schedules) if schedules else None
        out.update(
            sequential_s=seq_s,
            pipelined_s=pipe_s,
            bound_s=bound_s,
            speedup=seq_s / pipe_s,
            efficiency=bound_s / pipe_s,
            schedule_s=schedule_s,
            schedule_efficiency=None if schedule_s is None else bound_s / schedule_s,
            engine_efficiency=None if schedule_s is None else schedule_s / pipe_s,
            n_groups=wl.leader.n_groups,
            tuner_settled=settled,
            tuner_first_n=first_n,
            tune_rechecks=cfg.tune_rechecks,
            tuner_path=[[n, round(wall, 4)] for n, wall in leader.tuner_path],
            bound_terms={
                "definition": "max over: each party's compute-lane busy seconds; each "
                "link direction's send->PEER tensor bytes / bandwidth; "
                "from the pipelined (auto) run's Trace, median over repeats",
                **terms,
            },
            sweep={str(n): t for n, t in sweep.items()},
            best_fixed_n=best_n,
            auto_vs_best=statistics.median(f / a for f, a in zip(runs[best_n], auto, strict=True)),
            auto_vs_best_of_medians=sweep[best_n] / pipe_s,
            chunks=cfg.chunks,
            link_vs_compute=statistics.median(
                link / c
                for link, c in zip(
                    calibration["link_s"], calibration["sequential_compute_s"], strict=True
                )
            ),
            calibration={
                "definition": "per timed round: compute_s, the median over unshaped "
                "n = 1 batches (`recalibrate` of them before the round, "
                "or with recalibrate = 0 the `warmup` ones) of both "
                "parties' compute per batch, from which link_s (seconds "
                "per batch per direction) is shaped; sequential_compute_s, "
                "the same busy time in that round's sequential run. "
                "link_vs_compute: median of link_s / "
                "sequential_compute_s",
                "recalibrate": cfg.recalibrate,
                **calibration,
            },
            unchunked_s=statistics.median(t for t, _ in whole) if whole else None,
            unchunked_efficiency=statistics.median(b / t for t, b in whole) if whole else None,
            runs={
                "sequential_s": seq,
                "pipelined_s": auto,
                **{f"n={n}": t for n, t in runs.items()},
                **({"unchunked_s": [t for t, _ in whole]} if whole else {}),
            },
        )
        if plot:
            plot_gantt(
                [
                    (f"sequential (n=1, fifo), {cfg.batches} batches", seq_trace),
                    (f"pipelined (auto n={wl.leader.n_groups}, priority)", pipe_trace),
                ],
                plot,
            )
            out["plot"] = plot
        if trace:
            seq_trace.write_chrome(f"{trace}/trace_sequential.json")
            pipe_trace.write_chrome(f"{trace}/trace_pipelined.json")
            out["trace_dir"] = trace

    async with asyncio.TaskGroup() as tg:
        tg.create_task(wl.follower.serve())
        tg.create_task(drive())
    return out


# -- the engine's own cost -----------------------------------------------------------------------
def _serial_order(wl: Workload, n: int) -> list[tuple[SplitParty, Op, list[tuple[SplitParty, Op]]]]:
    """A valid serial execution of both parties' plans: (party, compute op, deliveries), where a
    delivery is the peer's receive op fed by one of the op's sends."""
    parties = {p.name: p for p in wl.parties}
    plans = {name: p.plan(n, "train") for name, p in parties.items()}
    remaining = {
        (name, op): len(plan.deps.get(op, ())) for name, plan in plans.items() for op in plan.ops
    }
    order = []
    done: set[tuple[str, Op]] = set()

    def complete(name: str, op: Op, deliveries: list) -> None:
        done.add((name, op))
        for s in plans[name].successors[op]:
            remaining[(name, s)] -= 1
            if remaining[(name, s)] == 0 and s.kind is Kind.SEND:
                recv = Op(Kind.RECV, s.mb, channel=s.channel, peer=name)
                deliveries.append((parties[s.peer], recv))
                complete(name, s, deliveries)
                complete(s.peer, recv, deliveries)

    while len(done) < len(remaining):
        progressed = False
        for name, plan in plans.items():
            for op in plan.ops:
                if op.is_compute and (name, op) not in done and remaining[(name, op)] == 0:
                    deliveries: list = []
                    complete(name, op, deliveries)
                    order.append((parties[name], op, deliveries))
                    progressed = True
                    break
        if not progressed:
            raise RuntimeError("no serial order: the plans deadlock")
    return order


def _direct(wl: Workload, order, idx: np.ndarray, n: int) -> None:
    """Run one batch's ops on the handlers directly: same kernels, no runtime/lanes/transport."""
    bounds = group_bounds(len(idx), n)
    wl.leader.handler.begin(None, wl.leader.labels["train"][idx], bounds, train=True)
    wl.follower.handler.begin(wl.follower.datasets["train"][idx], None, bounds, train=True)
    for party, op, deliveries in order:
        outputs = party.handler.compute(op)
        for peer, recv in deliveries:
            peer.handler.receive(recv, outputs[(recv.channel, recv.mb)])


class _Worker:
    """A bare worker thread: ``call(fn)`` hands ``fn`` over a `queue.SimpleQueue`, blocks for the
    result coming back the same way. The floor under any "compute off the calling thread"
    design: two thread wake-ups per call and nothing else."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="bench-handoff", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (fn := self._jobs.get()) is not None:
            self._done.put(fn())

    def call(self, fn):
        self._jobs.put(fn)
        return self._done.get()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()


def _direct_handoff(wl: Workload, order, idx: np.ndarray, n: int, worker: _Worker) -> None:
    """`_direct` with every compute op handed to a worker thread and back (no overlap)."""
    bounds = group_bounds(len(idx), n)
    wl.leader.handler.begin(None, wl.leader.labels["train"][idx], bounds, train=True)
    wl.follower.handler.begin(wl.follower.datasets["train"][idx], None, bounds, train=True)
    for party, op, deliveries in order:
        outputs = worker.call(functools.partial(party.handler.compute, op))
        for peer, recv in deliveries:
            peer.handler.receive(recv, outputs[(recv.channel, recv.mb)])


async def measure_overhead(cfg: BenchConfig, log: Callable[[str], None] = _log) -> dict[str, Any]:
    n, k = cfg.overhead_groups, cfg.overhead_batches
    wl = Workload(
        batch_size=cfg.overhead_batch,
        n_batches=1,
        d_in=cfg.overhead_width,
        hidden=(cfg.overhead_width,),
        cut=cfg.overhead_width,
        top_hidden=(),
        seed=cfg.seed,
        groups=n,
    )
    idx = wl.batch_indices(1)[0]
    out: dict[str, Any] = {}

    async def drive() -> None:
        wl.set(policy="priority", trace=None)
        order = _serial_order(wl, n)
        walls, direct, handoff, cpu = [], [], [], []  # cpu: (runtime, direct) process seconds
        worker = _Worker()
        try:
            async with ThreadLane("bench-overhead") as lane:
                await wl.run_fixed(lane, n, [idx] * 2)  # compile + warm
                _direct(wl, order, idx, n)
                _direct_handoff(wl, order, idx, n, worker)
                for _ in range(cfg.repeats):  # interleaved: a load spike hits one round only
                    c0 = time.process_time()
                    walls.append(await wl.run_fixed(lane, n, [idx] * k))
                    c1 = time.process_time()
                    t0 = time.perf_counter()
                    for _ in range(k):
                        _direct(wl, order, idx, n)
                    direct.append(time.perf_counter() - t0)
                    cpu.append((c1 - c0, time.process_time() - c1))
                    t0 = time.perf_counter()
                    for _ in range(k):
                        _direct_handoff(wl, order, idx, n, worker)
                    handoff.append(time.perf_counter() - t0)
        finally:
            worker.close()
        await wl.leader.stop()
        plan_ops = sum(len(p.plan(n, "train").ops) for p in wl.parties) * k
        compute_ops = sum(len(p.plan(n, "train").compute_ops) for p in wl.parties) * k
        extra = statistics.median(w - d for w, d in zip(walls, direct, strict=True))
        wall, base = statistics.median(walls), statistics.median(direct)
        out.update(
            overhead_us_per_op=extra / plan_ops * 1e6,
            overhead_us_per_compute_op=extra / compute_ops * 1e6,
            overhead_cpu_us_per_op=statistics.median(r - d for r, d in cpu) / plan_ops * 1e6,
            handoff_us_per_compute_op=statistics.median(
                h - d for h, d in zip(handoff, direct, strict=True)
            )
            / compute_ops
            * 1e6,
            overhead={
                "definition": "median over interleaved rounds of (runtime wall - "
                "direct handler loop) / ops; ops = all plan ops "
                "(F/L/B/U + S/R) of both parties; see "
                "docs/pipeline-bench.md, 'The overhead, defined'",
                "runtime_s": wall,
                "direct_s": base,
                "direct_handoff_s": statistics.median(handoff),
                "plan_ops": plan_ops,
                "compute_ops": compute_ops,
                "n_groups": n,
                "batch_size": cfg.overhead_batch,
                "batches": k,
                "loop": type(asyncio.get_running_loop()).__module__,
                "loadavg_1m": os.getloadavg()[0],
            },
        )
        log(
            f"overhead: runtime {wall * 1e3:.1f} ms, direct {base * 1e3:.1f} ms, direct with "
            f"hand-offs {statistics.median(handoff) * 1e3:.1f} ms, {plan_ops} plan ops -> "
            f"{out['overhead_us_per_op']:.1f} us/op"
        )

    async with asyncio.TaskGroup() as tg:
        tg.create_task(wl.follower.serve())
        tg.create_task(drive())
    return out


async def run_benchmark(
    cfg: BenchConfig,
    *,
    plot: str | None = None,
    trace: str | None = None,
    log: Callable[[str], None] = _log,
    pinned: tuple[int, set[int]] | None = None,
) -> dict[str, Any]:
    """The whole benchmark: the pipeline measurement, then the overhead measurement.

    ``pinned`` = (cpu, cpus): the loop's thread was pinned to ``cpu`` as ``tandem`` pins it
    (`tandem.parties.cli.affinity`); the overhead is then measured a second time with the
    threads free to run on ``cpus`` (``overhead_unpinned_us_per_op``), so one run shows what
    the pin is worth."""
    t0 = time.perf_counter()
    result = await measure_pipeline(cfg, log, plot, trace)
    result.update(await measure_overhead(cfg, log))
    result["python_threads_cpu"] = None if pinned is None else pinned[0]
    if pinned is not None:
        cpu, free = pinned
        os.sched_setaffinity(0, free)  # lanes started from now on inherit the free mask
        try:
            log("overhead again, threads not pinned")
            free_run = await measure_overhead(cfg, log)
        finally:
            os.sched_setaffinity(0, {cpu})
        result["overhead_unpinned_us_per_op"] = free_run["overhead_us_per_op"]
        result["overhead_unpinned_cpu_us_per_op"] = free_run["overhead_cpu_us_per_op"]
    result["bench_s"] = time.perf_counter() - t0
    result["loadavg"] = list(os.getloadavg())
    bad = [k for k, v in result.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise RuntimeError(f"non-finite results {bad}: {result}")
    return result


def _run(coro):
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where available
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.pipeline", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--json", action="store_true", help="print one JSON line on stdout")
    ap.add_argument("--plot", metavar="PATH", help="write a Gantt PNG: sequential vs pipelined")
    ap.add_argument(
        "--trace",
        metavar="DIR",
        help="write Chrome traces (Perfetto) of the first timed sequential and pipelined runs",
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test): `QUICK`")
    ap.add_argument(
        "--print-plan",
        action="store_true",
        help="print the order of each timed round's runs for every count the tuner may "
        "settle on (JSON), and exit without running",
    )
    ap.add_argument(
        "--sweep",
        type=lambda text: tuple(int(v) for v in text.split(",")),
        help="fixed group counts timed besides auto, comma-separated "
        f"({','.join(map(str, BenchConfig.sweep))})",
    )
    ap.add_argument("--batches", type=int, help=f"batches per timed run ({BenchConfig.batches})")
    ap.add_argument("--repeats", type=int, help=f"timed rounds ({BenchConfig.repeats})")
    ap.add_argument("--batch-size", type=int, help=f"rows per batch ({BenchConfig.batch_size})")
    ap.add_argument("--seed", type=int, help=f"seed ({BenchConfig.seed})")
    ap.add_argument(
        "--chunks",
        type=int,
        help=f"messages per group in the pipelined runs (1: whole groups; {BenchConfig.chunks})",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        help=f"unshaped n = 1 batches measuring compute before tuning ({BenchConfig.warmup})",
    )
    ap.add_argument(
        "--recalibrate",
        type=int,
        help="unshaped n = 1 batches re-measuring the compute before each timed "
        "round, the link re-shaped from them (0, the default: shape it once)",
    )
    ap.add_argument(
        "--tune-rechecks",
        type=int,
        help="re-checks the tuner goes through before the timed rounds (0: time "
        f"right after its first search; {BenchConfig.tune_rechecks})",
    )
    ap.add_argument(
        "--link-ratio",
        type=float,
        help="link time per batch as a multiple of the measured compute per batch "
        f"(1: the balance; above 1 the link binds; {BenchConfig.link_ratio})",
    )
    args = ap.parse_args(argv)
    given = {
        k: v
        for k in (
            "batches",
            "repeats",
            "batch_size",
            "seed",
            "chunks",
            "warmup",
            "recalibrate",
            "tune_rechecks",
            "link_ratio",
            "sweep",
        )  # fmt: skip
        if (v := getattr(args, k)) is not None
    }
    cfg = BenchConfig(**{**(QUICK if args.quick else {}), **given})
    if args.print_plan:
        print(json.dumps(timed_rounds(cfg)))
        return 0
    # pin the loop's thread (and the lanes it starts) to one CPU, as `tandem` does
    free = thread_cpus()
    cpu = colocate_python_threads()
    result = _run(
        run_benchmark(
            cfg, plot=args.plot, trace=args.trace, pinned=None if cpu is None else (cpu, free)
        )
    )
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
            "chunks",
            "unchunked_s",
            "unchunked_efficiency",
            "auto_vs_best",
            "auto_vs_best_of_medians",
            "overhead_us_per_op",
            "overhead_unpinned_us_per_op",
        ):
            print(f"{key:>23}: {result.get(key)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
