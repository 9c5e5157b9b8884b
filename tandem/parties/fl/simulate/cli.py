"""``tandem fl simulate``: N virtual clients, K sampled (and alive) per round, in one process.

Data: one table split over the clients by a seeded Dirichlet split over the label
(``--table URL --label COLUMN``, default scikit-learn's digits), or one file per client
(``--clients-glob PATTERN --label COLUMN``; the number of clients is the number of files).
Progress on stderr; one JSON line on stdout: clients, per round, rounds, parameters, the final
test accuracy (percent; None without a test set), seconds per round, the most client
states alive at once, and with ``--validation SHARE`` the clients' last evaluation of the
global model on their held-out rows (``client_eval``: `tandem.parties.fl.evaluation`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np

from tandem.errors import ConfigError, TandemError
from tandem.parties.progress import emit_result


def register_simulate(fl_sub) -> None:
    p = fl_sub.add_parser(
        "simulate", help="N virtual clients through the real server and client code"
    )
    p.add_argument("--clients", type=int, default=100, help="virtual clients N")
    p.add_argument("--per-round", type=int, default=10, help="clients sampled per round K")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--table", help="one table (CSV, Parquet, npz; path or fsspec URL)")
    p.add_argument("--clients-glob", help="one table file per client (a glob pattern)")
    p.add_argument("--label", default="label", help="label column of --table / --clients-glob")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet label skew")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", default="128,64", help="hidden layer sizes, comma separated")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05, help="client SGD learning rate")
    p.add_argument("--timeout", type=float, default=60.0, help="per-round deadline (s)")
    p.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="train client rounds as Ray tasks on this cluster ('auto', 'ray://host:10001', "
        "or 'local' to start one here; the ray extra)",
    )
    p.add_argument(
        "--validation",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="share of each client's rows held out of its training; the clients then evaluate "
        "the global model on them every round (federated evaluation)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=simulate_command)


def _source(args: argparse.Namespace):
    """(source, test set or None, number of classes)."""
    from ..data import load_federated_digits
    from .sources import ClientSource, FilePerClient, TablePartition

    if args.table and args.clients_glob:
        raise ConfigError("give --table or --clients-glob, not both")
    if args.clients_glob:
        files = FilePerClient(args.clients_glob, args.label)
        labels = np.concatenate([files.load(i)[1] for i in range(min(len(files), 50))])
        return files, None, int(labels.max()) + 1
    if args.table:
        from tandem.parties.data.table import read_table

        t = read_table(args.table)
        names = [n for n in t.available if n not in (args.label, "id")]
        text = [n for n in names if t.kind(n) not in ("int", "float")]
        if text:
            raise ConfigError(
                f"--table {args.table!r}: columns {text} are not numeric; a simulated "
                "client's features must be numbers (drop them from the table)"
            )
        x = np.stack([np.asarray(t[n].values, np.float32) for n in names], axis=1)
        y = np.asarray(t[args.label].values).astype(np.int32)
        src: ClientSource = TablePartition(x, y, args.clients, alpha=args.alpha, seed=args.seed)
        return src, None, int(y.max()) + 1
    data = load_federated_digits(1, 1.0, args.seed)
    x, y = data.clients[0]
    src = TablePartition(x, y, args.clients, alpha=args.alpha, seed=args.seed)
    return src, (data.x_test, data.y_test), data.num_classes


async def simulate_command(args: argparse.Namespace) -> int:
    import optax

    from ..evaluation import latest, round_text
    from ..server import FLConfig
    from ..train import LocalTrainer
    from .run import simulate

    try:
        src, test, classes = await asyncio.to_thread(_source, args)
        features = (await asyncio.to_thread(src.load, 0))[0].shape[1]
        hidden = [int(h) for h in args.hidden.split(",") if h]
        sizes = [features, *hidden, classes]
        if args.ray:
            from .on_ray import RayTrainer, connect

            await asyncio.to_thread(connect, args.ray)
            trainer: LocalTrainer = RayTrainer(
                {"sizes": sizes, "lr": args.lr, "epochs": args.epochs, "batch_size": 16,
                 "init_seed": args.seed, "loss": "softmax"}
            )  # fmt: skip
        else:
            trainer = LocalTrainer(
                sizes, optax.sgd(args.lr), epochs=args.epochs, init_seed=args.seed
            )
        cfg = FLConfig(
            rounds=args.rounds,
            seed=args.seed,
            round_timeout=args.timeout,
            client_eval=args.validation > 0,
        )

        def on_round(rep) -> None:
            if not args.quiet:
                acc = "" if rep.accuracy is None else f", accuracy {100 * rep.accuracy:.2f}%"
                print(
                    f"round {rep.round + 1}/{args.rounds}: {len(rep.accepted)}/"
                    f"{len(rep.sampled)} clients, {rep.seconds:.2f} s{acc}"
                    f"{round_text(rep.evaluation)}",
                    file=sys.stderr,
                    flush=True,
                )

        t0 = time.perf_counter()
        server = await simulate(
            src,
            trainer,
            cfg,
            per_round=args.per_round,
            test_set=test,
            on_round=on_round,
            validation=args.validation,
        )
        seconds = time.perf_counter() - t0
    except TandemError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    last = server.reports[-1].accuracy if server.reports else None
    emit_result(
        {
            "clients": len(src),
            "per_round": args.per_round,
            "rounds": args.rounds,
            "params": trainer.dim,
            "accuracy": None if last is None else round(100 * last, 2),
            "s_per_round": round(seconds / max(1, args.rounds), 4),
            "peak_live_clients": server.pool.peak,
            "client_eval": latest(server.reports),
        }
    )
    return 0
