"""`tandem demo`: leader + follower in one process on the breast-cancer data split by columns.

Trains on a shaped in-memory link, evaluates on a held-out split, then times the same
training batches sequentially (n = 1, FIFO order) and pipelined (the tuned n) on that link and
reports the speedup. Prints one JSON line at the end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import numpy as np

from tandem._extras import needs, require
from tandem.engine.data import epoch_batches
from tandem.engine.kernels import mlp_stage
from tandem.engine.topology import leader_follower
from tandem.engine.trace import Trace, plot_gantt
from tandem.parties.progress import emit_result
from tandem.transports.memory import MemoryNetwork

from ..party import SplitConfig, SplitParty


@dataclasses.dataclass
class DemoData:
    leader: dict[str, np.ndarray]
    follower: dict[str, np.ndarray]
    labels: dict[str, np.ndarray]


def load_breast_cancer_split(seed: int = 0, test_fraction: float = 0.25) -> DemoData:
    """scikit-learn's bundled breast-cancer data, standardised on the training split, columns
    0-14 to the leader and 15-29 to the follower. Needs the ``demo`` extra (`tandem._extras`)."""
    with needs("demo", "tandem demo (scikit-learn's breast-cancer data)"):
        from sklearn.datasets import load_breast_cancer
        from sklearn.model_selection import train_test_split

    X, y = load_breast_cancer(return_X_y=True)
    Xtr, Xte, ytr, yte = train_test_split(
        X, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    mu, sd = Xtr.mean(0), Xtr.std(0) + 1e-8
    Xtr, Xte = ((Xtr - mu) / sd).astype(np.float32), ((Xte - mu) / sd).astype(np.float32)
    half = X.shape[1] // 2
    return DemoData(
        leader={"train": Xtr[:, :half], "test": Xte[:, :half]},
        follower={"train": Xtr[:, half:], "test": Xte[:, half:]},
        labels={"train": ytr.astype(np.float32), "test": yte.astype(np.float32)},
    )


def demo_models(d_leader: int, d_follower: int, cut: int, hidden: int):
    return {
        "bottom_leader": mlp_stage([d_leader], [hidden], cut),
        "bottom_follower": mlp_stage([d_follower], [hidden], cut),
        "top": mlp_stage([cut, cut], [hidden], 1, activate_last=False),
    }


async def run_demo(
    *,
    epochs: int = 8,
    batch_size: int = 64,
    groups="auto",
    seed: int = 0,
    bandwidth: float = 1e6,
    latency: float = 0.002,
    cut: int = 128,
    hidden: int = 64,
    trace_dir: str | None = None,
    progress: bool = True,
    timing_batches: int = 4,
    chunks: int = 1,
) -> dict:
    data = load_breast_cancer_split(seed)
    topo = leader_follower()
    cfg = SplitConfig(
        batch_size=batch_size,
        epochs=epochs,
        groups=groups,
        seed=seed,
        learning_rate=3e-3,
        loss="binary",
        chunks=chunks,
    )
    models = demo_models(
        data.leader["train"].shape[1], data.follower["train"].shape[1], cut, hidden
    )
    net = MemoryNetwork()
    net.shape("leader", "follower", bandwidth=bandwidth, latency=latency, both=True)
    leader = SplitParty(
        "leader",
        topo,
        models,
        net.endpoint("leader"),
        datasets=data.leader,
        labels=data.labels,
        config=cfg,
    )
    follower = SplitParty(
        "follower", topo, models, net.endpoint("follower"), datasets=data.follower, config=cfg
    )
    result: dict = {}

    async def drive() -> None:
        n_batches = len(epoch_batches(len(data.labels["train"]), batch_size, 0, seed))
        await _train_with_bar(leader, epochs, n_batches, progress)
        metrics = await leader.evaluate("test")
        # the tuner may still be trying a neighbour after a short run: time its best n so far
        tuned = leader.tuner_state.best if groups == "auto" else leader.n_groups
        result.update(
            test_accuracy=metrics["accuracy"],
            test_auc=metrics["auc"],
            test_loss=metrics["loss"],
            train_loss=leader.history[-1].loss,
            n_groups=tuned,
            tuner_settled=leader.tuner_state.settled,
            epochs=epochs,
        )
        idx_list = epoch_batches(len(data.labels["train"]), batch_size, 0, seed)[:timing_batches]
        timings, traces = await _time_schedules(leader, follower, idx_list, tuned, chunks)
        result.update(
            sequential_s=timings["sequential"],
            pipelined_s=timings["pipelined"],
            speedup=timings["sequential"] / timings["pipelined"],
        )
        if trace_dir:
            out = Path(trace_dir)
            traces["pipelined"][1].write_chrome(out / "trace_pipelined.json")
            traces["sequential"][1].write_chrome(out / "trace_sequential.json")
            plot_gantt([traces["sequential"], traces["pipelined"]], out / "gantt.png")
            result["trace_dir"] = str(out)
        await leader.stop()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(follower.serve())
        tg.create_task(drive())
    result["link"] = {"bandwidth_Bps": bandwidth, "latency_s": latency}
    return result


async def _train_with_bar(leader: SplitParty, epochs: int, n_batches: int, progress: bool) -> None:
    """Train ``epochs`` epochs one at a time, a progress bar per epoch (on stderr)."""
    from rich.progress import BarColumn, TaskID, TextColumn, TimeElapsedColumn

    from tandem.parties.progress import progress_bar

    with progress_bar(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} batches  loss {task.fields[loss]}"),
        TimeElapsedColumn(),
        enabled=progress,
    ) as bar:
        for epoch in range(epochs):
            task = bar.add_task(f"epoch {epoch + 1}/{epochs}", total=n_batches, loss="-")

            def show(_epoch: int, done: int, loss: float, task: TaskID = task) -> None:
                bar.update(task, completed=done, loss=f"{loss:.4f}")

            hist = await leader.fit(1, on_batch=show)
            bar.update(task, loss=f"{hist[-1].loss:.4f}  n={leader.n_groups}")


async def _time_schedules(
    leader: SplitParty, follower: SplitParty, idx_list: list, tuned: int, chunks: int
) -> tuple[dict[str, float], dict[str, tuple[str, Trace]]]:
    """Time the same batches sequential (n=1, FIFO) and pipelined (``tuned`` n, priorities);
    returns the seconds and the labelled trace of each.

    Each timing starts with both parties idle and ends when BOTH finished the last batch (the
    leader's run_batch returns before the follower's last backward and update)."""
    timings, traces = {}, {}
    for label, n, policy in (("sequential", 1, "fifo"), ("pipelined", tuned, "priority")):
        tr = Trace()
        for party in (leader, follower):
            party.trace, party.config.policy = tr, policy
        leader.config.chunks = chunks if policy == "priority" else 1  # sequential: whole
        # one untimed batch first: shapes training never used (n = 1 after a tuned run,
        # or whole groups after chunked ones) compile here, not inside the timing
        await leader.run_batch(idx_list[0], n=n)
        await follower.wait_batches(leader.batches_done)
        tr.events.clear()  # the trace shows the timed batches only
        t0 = time.perf_counter()
        for idx in idx_list:
            await leader.run_batch(idx, n=n)
        await follower.wait_batches(leader.batches_done)
        timings[label] = time.perf_counter() - t0
        traces[label] = (f"{label} (n={n}, {policy})", tr)
    for party in (leader, follower):
        party.trace, party.config.policy = None, "priority"
    return timings, traces


async def demo_command(args) -> int:
    if args.trace:  # fail before training, not after it
        require("plot", "tandem demo --trace (the Gantt picture)")
    result = await run_demo(
        epochs=args.epochs,
        batch_size=args.batch_size,
        groups=args.groups if args.groups == "auto" else int(args.groups),
        seed=args.seed,
        bandwidth=args.bandwidth,
        latency=args.latency,
        trace_dir=args.trace,
        progress=not args.quiet,
        chunks=args.chunks,
    )
    emit_result(result)
    return 0 if result["test_accuracy"] >= 0.9 else 1
