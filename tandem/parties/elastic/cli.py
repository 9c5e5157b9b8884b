"""``tandem elastic ...``: the three roles over HTTP, a one-process demo, and example data.

    tandem elastic prepare --out DIR            # model.json, shard0/1.npz, part0/1.csv
    tandem elastic coordinator --config coordinator.toml [--summary out.json]
    tandem elastic data-server --config ds0.toml
    tandem elastic worker --config w0.toml
    tandem elastic demo [--workers 3] [--churn]  # everything in one process, memory transport
    tandem elastic launch --config job.toml [--ray ADDRESS] [--summary out.json]  # on Ray

Progress and status lines go to stderr; stdout carries only each command's result, one JSON
line (the coordinator's and the demo's summary, a worker's batch count, what prepare wrote).

Config files are TOML (read through fsspec, so any fsspec URL works). See
``examples/elastic/`` and ``docs/elastic.md`` for every key.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import tomllib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tandem._extras import needs, require
from tandem.errors import TandemError
from tandem.parties.progress import emit_result

from .build import coordinator_config, data_server, load_data_server, role_transport
from .config import CoordinatorFile, DataServerFile, WorkerFile, load_role
from .errors import ConfigError, NotWelcomedError

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

PLOT_PURPOSE = "tandem elastic demo --plot"


def register(sub) -> None:
    p = sub.add_parser("elastic", help="elastic training: coordinator, data servers, workers")
    roles = p.add_subparsers(dest="role", metavar="ROLE", required=True)
    for role, fn, text in (
        ("coordinator", _coordinator, "survival detection + batch ledger"),
        ("data-server", _data_server, "one shard + a parameter server"),
        ("worker", _worker, "a stateless worker"),
    ):
        r = roles.add_parser(role, help=text)
        r.add_argument("--config", required=True, help="TOML file (path or fsspec URL)")
        r.add_argument("-v", "--verbose", action="store_true")
        if role == "coordinator":
            r.add_argument("--summary", help="write the run's summary as JSON here")
        r.set_defaults(func=fn)
    la = roles.add_parser(
        "launch", help="every role as Ray actors on a Ray cluster (tandem[ray], docs/cluster.md)"
    )
    la.add_argument("--config", required=True, help="the job file (path or fsspec URL)")
    la.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="the Ray cluster ('auto', ray://...; default [ray] address)",
    )
    la.add_argument("--summary", help="write the run's summary as JSON here")
    la.add_argument("-v", "--verbose", action="store_true")
    la.set_defaults(func=_launch)
    d = roles.add_parser("demo", help="everything in one process on the memory transport")
    d.add_argument("--workers", type=int, default=3)
    d.add_argument("--data-servers", type=int, default=2)
    d.add_argument("--epochs", type=int, default=5)
    d.add_argument("--rows", type=int, default=512, help="rows per shard")
    d.add_argument("--interval", type=float, default=0.1, help="detection interval T (s)")
    d.add_argument(
        "--churn", action="store_true", help="kill a worker and add a new one during training"
    )
    d.add_argument(
        "--on-change",
        choices=("rollback", "keep"),
        default="rollback",
        help="what a membership change does (docs/elastic.md)",
    )
    d.add_argument("--quiet", action="store_true")
    d.add_argument("--plot", metavar="PNG", help="save the loss per epoch and the detections")
    d.set_defaults(func=_demo)
    m = roles.add_parser("prepare", help="write a model description and shards to a folder")
    m.add_argument("--out", required=True, help="folder or fsspec URL prefix")
    m.add_argument("--shards", type=int, default=2)
    m.add_argument("--rows", type=int, default=512)
    m.set_defaults(func=_prepare)


# -- building from the checked files (`build`) ----------------------------------------------
def _roster(cfg: CoordinatorFile) -> dict[str, str]:
    """The workers of ``[workers]`` and of the roster file (re-read on each call)."""
    from .spec import _read

    workers = dict(cfg.workers)
    if cfg.roster is not None:
        try:
            workers.update(tomllib.loads(_read(cfg.roster).decode()))
        except (TandemError, tomllib.TOMLDecodeError) as exc:
            log.warning("cannot read roster %s: %s", cfg.roster, exc)
    return {str(k): str(v) for k, v in workers.items()}


def _logging(args) -> None:
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


def _fail(exc: BaseException) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return 2


# -- roles -----------------------------------------------------------------------------------
def _progress_printer() -> Callable[[Any], None]:
    """A coordinator progress callback printing a status line to stderr when it changes."""
    last: dict[str, tuple] = {}

    def progress(p) -> None:
        key = (p.epoch, p.committed, p.live, p.rollbacks, p.loss)
        if key != last.get("k"):
            last["k"] = key
            loss = f" loss {p.loss:.4f}" if p.loss is not None else ""
            print(
                f"epoch {p.epoch} committed {p.committed}/{p.total} live {p.live} "
                f"gen {p.generation} rollbacks {p.rollbacks}{loss}",
                file=sys.stderr,
                flush=True,
            )

    return progress


async def _coordinator(args) -> int:
    from .coordinator import Coordinator

    _logging(args)
    try:
        cfg = load_role(CoordinatorFile, args.config)
        ccfg = coordinator_config(cfg)
    except TandemError as exc:
        return _fail(exc)
    peers = {**cfg.data_servers, **_roster(cfg)}
    async with role_transport(cfg, peers, admit_unknown=cfg.admit) as t:
        coord = Coordinator(t, ccfg, on_progress=_progress_printer())

        async def refresh() -> None:  # operators add workers to the roster while it runs
            while True:
                await asyncio.sleep(ccfg.interval)
                for name, url in _roster(cfg).items():
                    if name not in t.peers:
                        t.add_peer(name, url)

        failed: list[Exception] = []
        try:
            async with asyncio.TaskGroup() as tg:
                watcher = tg.create_task(refresh())
                try:
                    summary = await coord.run()
                finally:
                    watcher.cancel()
        except* TandemError as group:
            failed.extend(group.exceptions)
        if failed:
            return _fail(failed[0])
    summary["events"] = [
        (t_, kind, detail)
        for t_, kind, detail in coord.events
        if kind in ("removed", "joined", "rollback", "epoch", "recover", "resumed", "kept")
    ]
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary, f)
    emit_result(_coordinator_result(summary))
    return 0


#: The name of the test metric each loss reports (its mean over the test rows).
TEST_METRIC = {"softmax": "test_cross_entropy", "binary": "test_log_loss", "mse": "test_mse"}


def test_metrics(test: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The result line's test metrics over every data server's test rows (weighted by rows):
    the mean of the loss in use under its name (`TEST_METRIC`: ``test_mse`` for a
    regression), and ``test_accuracy`` for a classifier."""
    rows = [t for t in test.values() if t.get("rows")]
    if not rows:
        return {}
    n = sum(t["rows"] for t in rows)
    out: dict[str, Any] = {}
    objective = rows[0].get("objective") or ("mse" if rows[0].get("accuracy") is None else None)
    if objective in TEST_METRIC and all(t.get("loss") is not None for t in rows):
        out[TEST_METRIC[objective]] = round(sum(t["loss"] * t["rows"] for t in rows) / n, 6)
    if all(t.get("accuracy") is not None for t in rows):
        out["test_accuracy"] = round(sum(t["accuracy"] * t["rows"] for t in rows) / n, 4)
    return out


def _coordinator_result(summary: dict[str, Any]) -> dict[str, Any]:
    """The coordinator's JSON line from its run's summary."""
    result = {
        "epochs": summary["epochs"],
        "rollbacks": summary["rollbacks"],
        "recoveries": summary["recoveries"],
        "restarts": summary.get("restarts", 0),
        "initial_loss": round(summary["initial_loss"], 4),
        "final_loss": round(summary["history"][-1]["loss"], 4),
    }
    if summary["resumed"] is not None:
        result["resumed"] = summary["resumed"]
    result.update(test_metrics(summary["test"]))
    if summary["exports"]:
        result["exports"] = summary["exports"]
    return result


def _use_compile_cache(
    setting: bool | str, checkpoints: str | None, export: str | None, config: str
) -> None:
    """Point this role process's JAX at its compile cache (``compile_cache``: default
    ``compile-cache`` in the checkpoint folder, else beside the export, else beside the TOML
    file), before its first compilation."""
    from tandem.parties.compile_cache import cache_folder, enable_compile_cache, role_homes

    homes = role_homes(checkpoints, export, config, checkpoint_is_file=False)
    enable_compile_cache(cache_folder(setting, homes))


async def _data_server(args) -> int:
    _logging(args)
    try:
        cfg = load_role(DataServerFile, args.config)
        _use_compile_cache(cfg.compile_cache, cfg.checkpoints, cfg.export, args.config)
        spec, shard, store, party = await load_data_server(cfg, args.config)
    except TandemError as exc:
        return _fail(exc)
    coord = cfg.coordinator_name
    async with role_transport(cfg, {coord: cfg.coordinator}) as t:
        ds = data_server(t, cfg, spec, shard, store, party)
        print(
            f"{cfg.name}: serving {len(shard.y)} rows ({ds.n_batches} batches) on {t.url}",
            file=sys.stderr,
            flush=True,
        )
        failed: list[Exception] = []
        try:
            await ds.run()
        except* TandemError as group:
            failed.extend(group.exceptions)
        if failed:
            return _fail(failed[0])
    return 0


async def _worker(args) -> int:
    from .worker import Worker

    _logging(args)
    try:
        cfg = load_role(WorkerFile, args.config)
        _use_compile_cache(cfg.compile_cache, None, None, args.config)
    except TandemError as exc:
        return _fail(exc)
    coord = cfg.coordinator_name
    async with role_transport(cfg, {coord: cfg.coordinator}) as t:
        try:  # the worker checks its own settings; name the file they came from
            worker = Worker(
                t,
                coordinator=coord,
                heartbeat=cfg.heartbeat,
                url=cfg.advertise_url or t.url,
                join_timeout=cfg.join_timeout,
            )
        except ValueError as exc:
            return _fail(ConfigError(f"config {args.config!r}: {exc}"))
        print(f"{cfg.name}: worker on {t.url}", file=sys.stderr, flush=True)
        try:
            await worker.run()
        except NotWelcomedError as exc:
            return _fail(exc)
        emit_result({"worker": cfg.name, "batches": worker.done})
    return 0


async def _launch(args) -> int:
    """``tandem elastic launch``: the job on a Ray cluster; the coordinator's result line plus
    what the supervisor did (``ray``: workers added, lost, restarts)."""
    from .ray import launch, read_job
    from .ray.launch import PURPOSE

    _logging(args)
    try:
        require("ray", PURPOSE)
        job = await asyncio.to_thread(read_job, args.config)
    except TandemError as exc:
        return _fail(exc)

    def said(event) -> None:
        _, kind, detail = event
        if kind != "placed" or args.verbose:
            print(f"ray: {kind} {json.dumps(detail)}", file=sys.stderr, flush=True)

    failed: list[Exception] = []
    try:
        summary = await launch(job, address=args.ray, on_event=said)
    except* TandemError as group:
        failed.extend(group.exceptions)
    if failed:
        return _fail(failed[0])
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary, f)
    emit_result({**_coordinator_result(summary), "ray": summary["ray"]})
    return 0


# -- demo and data ---------------------------------------------------------------------------
async def _prepare(args) -> int:
    from .spec import ModelSpec, make_dataset, save_shard

    spec = ModelSpec(sizes=(16, 32, 4), optimizer="adam", lr=0.01, batch_size=32, seed=0)
    out = args.out.rstrip("/")
    import fsspec

    fs, path = fsspec.core.url_to_fs(out)
    fs.makedirs(path, exist_ok=True)
    with fsspec.open(f"{out}/model.json", "w") as f:
        json.dump(spec.to_dict(), f)
    shards = [f"{out}/shard{i}.npz" for i in range(args.shards)]
    tables = [f"{out}/part{i}.csv" for i in range(args.shards)]
    made = make_dataset(args.shards, args.rows, spec)
    for i, (shard, url) in enumerate(zip(made, shards, strict=True)):
        save_shard(shard, url)
        # the same rows as a table for the [data] form (docs/data.md)
        header = ",".join(["id", *(f"f{j}" for j in range(shard.x.shape[1])), "label"])
        lines = [header] + [
            ",".join([f"s{i}r{r}", *(f"{v:.6g}" for v in shard.x[r]), str(int(shard.y[r]))])
            for r in range(len(shard.y))
        ]
        with fsspec.open(tables[i], "w") as f:
            f.write("\n".join(lines) + "\n")
    print(
        json.dumps(
            {"model": f"{out}/model.json", "shards": shards, "tables": tables, "rows": args.rows}
        )
    )
    return 0


def _demo_progress(args, total: int):
    """(a rich progress bar or None with --quiet, the cluster's progress callback)."""
    if args.quiet:
        return None, lambda p: None
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

    from tandem.parties.progress import progress_bar

    bar = progress_bar(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} batches"),
        TimeElapsedColumn(),
    )
    job = bar.add_task("elastic", total=total)

    def progress(p) -> None:
        per = total // args.epochs
        loss = f" loss {p.loss:.3f}" if p.loss is not None else ""
        bar.update(
            job,
            completed=min(total, p.epoch * per + p.committed),
            description=f"epoch {p.epoch} live {p.live} gen {p.generation} "
            f"rollbacks {p.rollbacks}{loss}",
        )

    return bar, progress


async def _demo(args) -> int:
    from .local import LocalCluster
    from .spec import ModelSpec, make_dataset

    if args.workers < 1 or args.data_servers < 1 or args.epochs < 1:
        return _fail(ConfigError("--workers, --data-servers and --epochs must be >= 1"))
    if args.plot:  # fail before training, not after it
        try:
            require("plot", PLOT_PURPOSE)
        except ConfigError as exc:
            return _fail(exc)
    spec = ModelSpec(sizes=(16, 32, 4), optimizer="adam", lr=0.01, batch_size=32, seed=0)
    shards = make_dataset(args.data_servers, args.rows, spec)
    total = sum(s.n_batches(spec.batch_size) for s in shards) * args.epochs
    bar, progress = _demo_progress(args, total)
    cluster = LocalCluster(
        spec,
        shards,
        interval=args.interval,
        epochs=args.epochs,
        workers=args.workers,
        on_change=args.on_change,
        on_progress=progress,
    )

    async def churn(c: LocalCluster) -> None:
        if not args.churn:
            return
        await asyncio.sleep(3 * args.interval)
        victim = c.alive()[0]
        c.kill(victim)
        await asyncio.sleep(3 * args.interval)
        c.spawn()

    if bar is not None:
        bar.start()
    try:
        summary = await cluster.run(churn)
    finally:
        if bar is not None:
            bar.stop()
    result = {
        "epochs": summary["epochs"],
        "rollbacks": summary["rollbacks"],
        "checkpoints": summary["checkpoints"],
        "reissued": summary["reissued"],
        "killed": cluster.killed,
        "initial_loss": round(summary["initial_loss"], 4),
        "final_loss": round(summary["history"][-1]["loss"], 4),
        "exactly_once": all(
            len(set(h["committed"])) == len(h["committed"]) == total // args.epochs
            for h in summary["history"]
        ),
    }
    if args.plot:
        await asyncio.to_thread(_plot, args.plot, summary, list(cluster.coordinator.events))
        result["plot"] = args.plot
    emit_result(result)
    return 0 if result["exactly_once"] else 1


def _plot(path: str, summary: dict, events: list) -> None:
    """Loss after each epoch against time, with rollbacks and removals marked, on a
    `matplotlib.figure.Figure` of its own (no pyplot state)."""
    with needs("plot", PLOT_PURPOSE):
        from matplotlib.figure import Figure

    t0 = events[0][0] if events else 0.0
    fig = Figure(figsize=(7, 3.5))
    ax = fig.subplots()
    ep = [(t - t0, loss) for t, kind, loss in events if kind == "epoch"]
    ax.plot(
        [0.0] + [t for t, _ in ep],
        [summary["initial_loss"]] + [v for _, v in ep],
        marker="o",
        label="loss (mean over shards)",
    )
    for i, (t, _, _) in enumerate(e for e in events if e[1] == "rollback"):
        ax.axvline(t - t0, color="red", alpha=0.4, label="rollback" if i == 0 else None)
    ax.set_yscale("log")
    ax.set_xlabel("seconds")
    ax.set_ylabel("cross-entropy")
    ax.set_title("elastic training: loss per committed epoch")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
