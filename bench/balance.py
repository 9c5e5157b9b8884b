"""Efficiency against the balance of link and compute: where a pipelined batch's time goes.

``python -m bench.balance --json`` prints ONE JSON line (progress goes to stderr).

`bench.pipeline` shapes its link to the *sequential* compute time, so the pipelined run lands
wherever the pipelined compute happens to fall against it (0.9-1.5 times the link on the 2-core
machine). This benchmark puts it where a pipeline is weakest, on purpose: the workload of
`bench.pipeline` at a fixed ``n`` and ``chunks``; party A's compute per batch is measured in
pipelined runs at that ``n`` on an unshaped link (its compute-lane busy seconds); then for each
``ratio`` the link is shaped so that one direction carries a batch's cut-layer tensor in
``ratio`` times that compute. At ratio 1 the compute lane, the activation link and the gradient
link all have the same work, and a batch can finish no sooner than each of them allows.

Reported per ratio (``ratios``, keyed by the ratio as a string):

* ``efficiency``: the median over ``repeats`` timed runs of bound / time, where the bound is
  `bench.pipeline`'s (each party's compute-lane busy seconds, each direction's bytes /
  bandwidth, from the run's own `Trace`);
* ``batch_ms`` and its parts, medians over every timed batch, read from the trace
  (`tandem.engine.batch_time.batch_parts`, A the bottom party, B the top). A batch
  starts when the previous one's update on A ended (the first event, for a run's first batch)
  and ends when its own update on A ends. Exactly
  ``batch_ms = fill_ms + grad_start_ms + grad_link_ms + grad_gaps_ms + drain_ms`` per batch:

  - ``fill_ms``: until the activation link starts (A's first forward, the first frame's hand-off);
  - ``grad_start_ms``: from the activation link's start to the gradient link's (the first part's
    transfer and latency, the first loss step);
  - ``grad_link_ms``: the gradient link's busy time (a batch's gradient bytes / bandwidth);
  - ``grad_gaps_ms``: the gradient link's idle time between its first and last transfer (a
    loss step that started late: the link cannot catch up, since the activations reach the loss
    party no faster than the gradients leave it);
  - ``drain_ms``: from the last gradient's arrival to the end of A's update (A's last backward
    and the update).

  What is not ``grad_link_ms`` is what the batch spends beyond its busiest link.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

from tandem.engine.batch_time import PARTS, batch_parts
from tandem.engine.lanes import ThreadLane
from tandem.engine.trace import Trace, plot_gantt
from tandem.errors import ConfigError
from tandem.parties.cli.affinity import colocate_python_threads

from .pipeline import A, B, BenchConfig, Workload, _bound, _run


@dataclasses.dataclass
class BalanceConfig:
    """Sizes of the benchmark; the model, latency and seed default to `BenchConfig`'s (one
    source for the workload both benchmarks share). About 12 s on 2 cores."""

    batch_size: int = BenchConfig.batch_size
    batches: int = BenchConfig.batches  # batches per timed run
    repeats: int = 5  # timed runs per ratio
    n_groups: int = 8
    chunks: int = BenchConfig.chunks
    ratios: tuple[float, ...] = (0.8, 1.0, 1.25)
    calibration: int = 3  # unshaped pipelined runs measuring A's compute
    d_in: int = BenchConfig.d_in
    hidden: tuple[int, ...] = BenchConfig.hidden
    cut: int = BenchConfig.cut
    top_hidden: tuple[int, ...] = BenchConfig.top_hidden
    latency: float = BenchConfig.latency
    seed: int = BenchConfig.seed

    def __post_init__(self) -> None:
        if min(self.batch_size, self.batches, self.repeats, self.calibration) < 1:
            raise ConfigError("batch_size, batches, repeats and calibration must be >= 1")
        if not 1 <= self.n_groups <= self.batch_size:
            raise ConfigError(
                f"n_groups must be in [1, batch_size={self.batch_size}], got {self.n_groups}"
            )
        if not self.ratios or any(not r > 0 for r in self.ratios):
            raise ConfigError(f"ratios must be positive link/compute ratios, got {self.ratios}")


#: ``--quick``: a tiny model, two ratios, seconds in all (the smoke test's size)
QUICK = dict(
    batch_size=32,
    batches=2,
    repeats=2,
    n_groups=4,
    chunks=2,
    ratios=(1.0, 2.0),
    calibration=1,
    d_in=8,
    hidden=(16,),
    cut=8,
    top_hidden=(4,),
)


def _log(msg: str) -> None:
    print(f"[bench.balance] {msg}", file=sys.stderr, flush=True)


async def measure_balance(
    cfg: BalanceConfig, *, log: Callable[[str], None] = _log, plot: str | None = None
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
    n, out = cfg.n_groups, {}
    link_bytes = cfg.batch_size * cfg.cut * 4

    async def drive() -> None:
        idx = wl.batch_indices(cfg.batches)
        async with ThreadLane("bench-leader") as lane:
            wl.set(policy="priority", trace=None)
            await wl.run_fixed(lane, n, idx)  # compile
            per_batch = []
            for _ in range(cfg.calibration):
                tr = Trace()
                wl.set(policy="priority", trace=tr)
                await wl.run_fixed(lane, n, idx)
                per_batch.append(tr.busy(A) / cfg.batches)
            compute = statistics.median(per_batch)
            log(f"A's compute per batch at n={n}, chunks={cfg.chunks}: {compute * 1e3:.1f} ms")
            out.update(
                compute_A_per_batch_s=compute,
                n_groups=n,
                chunks=cfg.chunks,
                batch_size=cfg.batch_size,
                ratios={},
            )
            gantt, drawn = None, min(cfg.ratios, key=lambda r: abs(r - 1))  # the plot's ratio
            for ratio in cfg.ratios:
                bandwidth = link_bytes / (compute * ratio)
                wl.net.shape(A, B, bandwidth=bandwidth, latency=cfg.latency, both=True)
                wl.set(policy="priority", trace=None)
                await wl.run_fixed(lane, n, idx)  # the first run on a new link: untimed
                effs, parts = [], []
                for _ in range(cfg.repeats):
                    tr = Trace()
                    wl.set(policy="priority", trace=tr)
                    wall = await wl.run_fixed(lane, n, idx)
                    effs.append(_bound(tr, bandwidth)[0] / wall)
                    parts += batch_parts(tr, A, B)
                    if ratio == drawn and gantt is None:
                        gantt = tr
                row = {
                    "efficiency": statistics.median(effs),
                    "efficiency_runs": [round(e, 3) for e in effs],
                    "link_per_batch_ms": link_bytes / bandwidth * 1e3,
                    **{k: statistics.median(p[k] for p in parts) for k in ("batch_ms", *PARTS)},
                }
                out["ratios"][f"{ratio:g}"] = row
                log(
                    f"ratio {ratio:g}: efficiency {row['efficiency']:.3f}, batch "
                    f"{row['batch_ms']:.1f} ms = "
                    + " + ".join(f"{k[:-3]} {row[k]:.1f}" for k in PARTS)
                )
            if plot and gantt is not None:
                plot_gantt(
                    [(f"n={n}, chunks={cfg.chunks}, link = {drawn:g} x A's compute", gantt)], plot
                )
                out["plot"] = plot
        wl.set(policy="priority", trace=None)
        await wl.leader.stop()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(wl.follower.serve())
        tg.create_task(drive())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.balance", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line on stdout")
    ap.add_argument(
        "--plot", metavar="PATH", help="write a Gantt PNG of a run at the ratio nearest 1"
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test): `QUICK`")
    ap.add_argument("--n-groups", type=int, help=f"groups per batch ({BalanceConfig.n_groups})")
    ap.add_argument("--chunks", type=int, help=f"messages per group ({BalanceConfig.chunks})")
    ap.add_argument("--batch-size", type=int, help=f"rows ({BalanceConfig.batch_size})")
    ap.add_argument("--repeats", type=int, help=f"runs per ratio ({BalanceConfig.repeats})")
    ap.add_argument(
        "--ratios",
        help="link time / A's compute time per batch, comma-separated ("
        + ",".join(f"{r:g}" for r in BalanceConfig.ratios)
        + ")",
    )
    args = ap.parse_args(argv)
    given: dict = {
        k: v
        for k in ("n_groups", "chunks", "batch_size", "repeats")
        if (v := getattr(args, k)) is not None
    }
    if args.ratios is not None:
        try:
            given["ratios"] = tuple(float(r) for r in args.ratios.split(","))
        except ValueError:
            ap.error(
                f"--ratios takes comma-separated numbers such as 0.8,1,1.25; got {args.ratios!r}"
            )
    cfg = BalanceConfig(**{**(QUICK if args.quick else {}), **given})
    colocate_python_threads()  # as `tandem` and bench.pipeline do
    result = _run(measure_balance(cfg, plot=args.plot))
    if args.json:
        print(json.dumps(result))
    else:
        for ratio, row in result["ratios"].items():
            print(
                f"ratio {ratio}: "
                + json.dumps(
                    {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
                )
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
